"""The program of :class:`osfarm.desktop.box.coderunner.CodeRunner`'s interpreter (never imported).

The runner copies this file into the interpreter's temp dir and runs it there. It must run on any
Python >= 3.8 with python-xlib + pyautogui (it may be the guest's /usr/bin/python3, which cannot
import osfarm), so it is self-contained: protocol, pyautogui's X11 patch, the settle zygote.
"""
import ast
import json
import linecache
import os
import struct
import sys
import traceback

sys.path[0] = ""  # like `python -c`: the working directory, not this file's temp dir

_rfd_text, _wfd_text, _outdir = os.environ.pop("OSFARM_KERNEL_IO").split(",", 2)
_rfd, _wfd = int(_rfd_text), int(_wfd_text)
# "osworld": pyautogui's defaults (PAUSE = 0.1 s after each call); "fast": PAUSE = 0
_timing = os.environ.pop("OSFARM_KERNEL_TIMING", "fast")


def _read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(_rfd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _recv():
    (n,) = struct.unpack(">I", _read_exact(4))
    return json.loads(_read_exact(n).decode("utf-8"))


def _send(obj):
    data = json.dumps(obj).encode("utf-8")
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(_wfd, data):]


def _char_keysym(ch):
    special = {"\n": 0xFF0D, "\r": 0xFF0D, "\t": 0xFF09, "\b": 0xFF08}
    if ch in special:
        return special[ch]
    cp = ord(ch)
    if cp < 0x20 or 0x7F <= cp < 0xA0:
        return None
    return cp if cp < 0x100 else 0x01000000 | cp


def _patch_pyautogui_x11(pyautogui):
    """Press single characters where the live keymap has them (see the module docstring)."""
    x11 = getattr(pyautogui, "platformModule", None)
    if x11 is None or not hasattr(x11, "keyboardMapping") or not hasattr(x11, "_display"):
        return
    from Xlib import X
    from Xlib.ext.xtest import fake_input
    from Xlib.protocol import event as xevent

    d = x11._display
    orig_down, orig_up = x11._keyDown, x11._keyUp
    bound = {}  # spare keycode -> keysym we bound

    def refresh():
        # pyautogui never reads events, so its keymap cache goes stale when someone remaps.
        for _ in range(d.pending_events()):
            ev = d.next_event()
            if isinstance(ev, xevent.MappingNotify):
                d.refresh_keyboard_mapping(ev)

    def shift_code():
        return d.keysym_to_keycode(0xFFE1)  # Shift_L

    def bind_spare(ks):
        info = d.display.info
        first = info.min_keycode + 1
        rows = d.get_keyboard_mapping(first, info.max_keycode - first + 1)
        spare = [first + i for i, r in enumerate(rows) if not any(r)]
        if spare:
            code = spare[-1]
        elif bound:
            code = next(iter(bound))
            del bound[code]
        else:
            return 0
        d.change_keyboard_mapping(code, [(ks, ks)])
        d.sync()
        d._update_keymap(code, 1)
        bound[code] = ks
        return code

    def resolve(ch):
        ks = _char_keysym(ch)
        if ks is None:
            return 0, False
        refresh()
        for code, level in d.keysym_to_keycodes(ks):
            if level in (0, 1):
                return code, level == 1
        return bind_spare(ks), False

    def key_down(key):
        if isinstance(key, str) and len(key) == 1:
            code, shift = resolve(key)
            if code:
                if shift:
                    fake_input(d, X.KeyPress, shift_code())
                fake_input(d, X.KeyPress, code)
                if shift:
                    fake_input(d, X.KeyRelease, shift_code())
                d.sync()
                return
        orig_down(key)

    def key_up(key):
        if isinstance(key, str) and len(key) == 1:
            code, _shift = resolve(key)
            if code:
                fake_input(d, X.KeyRelease, code)
                d.sync()
                return
        orig_up(key)

    x11._keyDown, x11._keyUp = key_down, key_up


def _prctl(option, value):
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except Exception:
        pass


def _guard_zygote():
    """The zygote is not dumpable: its children run the agent's code as the same user, and a
    dumpable parent would let them open /proc/<zygote>/mem (state kept for the next action's
    child, which starts from that memory), trace it, or open its fds (the pipes to the guest)."""
    _prctl(4, 0)  # PR_SET_DUMPABLE


_ns = {"__name__": "__main__", "__builtins__": __builtins__}
_settle = None  # "settle": the module with InputSettle, shipped next to this file
_spare = None  # "settle": X connections opened for the next forked child
_boot_error = None
try:
    exec("import time\nimport pyautogui\n" + ("pyautogui.PAUSE = 0\n" if _timing == "fast" else "")
         + "pyautogui.FAILSAFE = False\n", _ns)
    if _timing == "settle":
        # A zygote: everything imported once, each action in a forked child (see _run_forked).
        # The child patches pyautogui on its own X connection, so the zygote does not here.
        import importlib.util
        _spec = importlib.util.spec_from_file_location(
            "osfarm_input_settle", os.path.join(os.path.dirname(os.path.abspath(__file__)), "osfarm_input_settle.py"))
        if _spec is None or _spec.loader is None:
            raise ImportError("osfarm_input_settle.py is missing next to the kernel")
        _settle = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_settle)
        from Xlib import display as _xdisplay
        _guard_zygote()
    else:
        _patch_pyautogui_x11(_ns["pyautogui"])
except BaseException:
    _boot_error = traceback.format_exc()
_send({"ready": True, "error": _boot_error})


def _die_with_zygote(zygote):
    """The guest kills the zygote on a timeout: its child running the code must go with it (the
    guest also kills the child by the pid the zygote reported: code can clear this signal)."""
    _prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != zygote:  # it died before the prctl took
        os._exit(1)
    _prctl(4, 1)  # dumpable again, as any process the agent starts (its /proc entries its own)


def _settled_child(run_id, code, zygote, owed):
    """In the forked child: OSWorld's fresh start for this code (pyautogui's defaults, globals
    holding only pyautogui and time, as `python -c "import pyautogui; import time; ..."`), with
    pyautogui's sleep of PAUSE after each call replaced by the settle wait (capped at PAUSE).
    ``owed``: what the guest's last input event still owes (InputSettle.give_owed), paid before
    this code's first event. Returns the error text and what this code's last event owes."""
    os.close(_rfd)
    os.close(_wfd)
    _die_with_zygote(zygote)
    pyautogui = _ns["pyautogui"]
    x11 = getattr(pyautogui, "platformModule", None)
    conn, settle = _spare if _spare is not None else _connect()
    settle.take_owed(owed)
    if x11 is not None and hasattr(x11, "_display"):
        # Not the zygote's own connection: its request sequence numbers went stale with every
        # earlier child, so replies would be matched to the wrong requests.
        x11._display = conn
    _patch_pyautogui_x11(pyautogui)
    default_pause, sleep_pause = pyautogui.PAUSE, pyautogui._handlePause
    # whether the call being paused after may move the focus (input_settle.focus_key), and whether
    # it pressed a mouse button (the wait then looks whether any app got the click)
    focus = [False, False]

    def flag(fn, when, button=False):
        def flagged(*args, **kwargs):
            if when(*args):
                focus[0] = True
                focus[1] = focus[1] or button
            return fn(*args, **kwargs)
        return flagged

    def paid(fn):  # every event first pays what the last one owes (and arms the answer's wait)
        def paying(*args, **kwargs):
            settle.before_event()
            return fn(*args, **kwargs)
        return paying

    if x11 is not None:
        for name in ("_mouseDown", "_mouseUp", "_click"):
            if hasattr(x11, name):
                setattr(x11, name, flag(getattr(x11, name), lambda *a: True, button=True))
        if hasattr(x11, "_keyDown"):
            x11._keyDown = flag(x11._keyDown, lambda key, *a: isinstance(key, str) and _settle.focus_key(key))
        for name in ("_moveTo", "_mouseDown", "_mouseUp", "_click", "_scroll", "_vscroll", "_hscroll",
                     "_keyDown", "_keyUp"):
            if hasattr(x11, name):
                setattr(x11, name, paid(getattr(x11, name)))

    def settled_pause(_pause):
        (focus_may_move, button), focus[:] = focus[:], [False, False]
        if _pause and pyautogui.PAUSE == default_pause:
            settle.wait(default_pause, focus_may_move, button)
        else:  # the code set its own PAUSE: it gets the sleep it asked for, as under OSWorld
            sleep_pause(_pause)

    pyautogui._handlePause = settled_pause
    err = _run(run_id, code, {"__name__": "__main__", "__builtins__": __builtins__,
                              "pyautogui": pyautogui, "time": _ns["time"]})
    return err, settle.give_owed()


def _connect():
    return _xdisplay.Display(os.environ["DISPLAY"]), _settle.InputSettle(os.environ["DISPLAY"])


def _prepare_spare():
    """Open the next child's two X connections now, between actions: connecting (python-xlib asks
    the server about every extension) is most of a child's start-up otherwise."""
    global _spare
    try:
        _spare = _connect()
    except Exception:
        _spare = None  # the child connects itself, and reports what fails


def _run_forked(run_id, code, owed):
    """Run ``code`` in a child forked from this zygote, paying ``owed`` first; its error text
    (None: it ran) and what its last input event owes."""
    global _spare
    d = getattr(getattr(_ns["pyautogui"], "platformModule", None), "_display", None)
    if d is not None:  # the zygote never reads its connection: drop what the server queued on it
        for _ in range(d.pending_events()):
            d.next_event()
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        owed_after = None
        try:
            os.close(r)
            err, owed_after = _settled_child(run_id, code, zygote, owed)
        except BaseException:
            err = traceback.format_exc()
        try:
            # at most ~60 KB of JSON, under a pipe's buffer: the write never blocks
            os.write(w, json.dumps([err if err is None else err[-10000:], owed_after]).encode("utf-8"))
        finally:
            os._exit(0)
    os.close(w)
    _send({"id": run_id, "child": pid})  # the guest kills it on a timeout, with this process
    if _spare is not None:  # the child's now: let go of this process's end, telling the server nothing
        _spare[0].display.socket.close()
        _spare[1].forget()
        _spare = None
    _, status = os.waitpid(pid, 0)
    os.set_blocking(r, False)
    data = b""
    try:
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:  # a process the code started holds the pipe open: we have it all
        pass
    os.close(r)
    if not data:
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        return f"code process exited (exit code {code})", None
    try:
        err, owed_after = json.loads(data.decode("utf-8"))
    except (ValueError, TypeError):  # the code wrote to the pipe itself: the guest checks what it gets anyway
        return "code process sent a malformed result", None
    return err, owed_after


def _run(run_id, code, ns):
    name = f"<code-{run_id}>"
    path = os.path.join(_outdir, f"{run_id}.out")
    out_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # the guest reads it
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    error = None
    try:
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        tree = ast.parse(code, name, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            # Like a notebook cell: echo the value of a trailing expression.
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), ns)
        if last is not None:
            value = eval(compile(last, name, "eval"), ns)
            if value is not None:
                print(repr(value))
    except SystemExit as e:
        if e.code not in (None, 0):
            error = f"SystemExit: {e.code!r}"
    except BaseException as e:
        tb = e.__traceback__
        # Drop this kernel's own frame so the traceback starts in the user's code.
        if tb is not None and tb.tb_frame.f_code is _run.__code__:
            tb = tb.tb_next
        error = "".join(traceback.format_exception(type(e), e, tb))
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    return error


if _timing == "settle" and _boot_error is None:
    _prepare_spare()
while True:
    try:
        req = _recv()
    except EOFError:
        break
    owed_after = None
    if _timing == "settle":
        err, owed_after = _run_forked(req["id"], req["code"], req.get("owed"))
    else:
        err = _run(req["id"], req["code"], _ns)
    _send({"id": req["id"], "error": err, "owed": owed_after})
    if _timing == "settle" and _boot_error is None:
        _prepare_spare()
