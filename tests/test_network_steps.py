"""What a setup command needs from the network (osfarm.tasks.network_steps), read from its text:
OSWorld's own commands, and the shapes a shell line can take. Nothing here runs a command; the
desktop side (packages looked up, steps failed or cut) is in tests/test_setup.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from osfarm.tasks.network_steps import NetworkNeeds, PipPackage, network_needs

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "shared" / "osworld" / "examples"
PW = "echo {CLIENT_PASSWORD} | "
PY3 = "python3"


def needs(command: str | list[str], shell: bool = True) -> NetworkNeeds:
    return network_needs(command, shell)


# ---------------------------------------------------------------------------- OSWorld's commands


def test_apt_update_and_install_then_local_work() -> None:
    # chrome/6766f2b8 and multi_apps/a74b607e: the unzip after the install is the task's setup
    zip_ = "/home/user/Desktop/helloExtension.zip"
    cmd = (f"{PW}sudo -S apt-get update -y && {PW}sudo -S apt-get install unzip -y && "
           f"unzip {zip_} -d /home/user/Desktop/ && rm {zip_}")
    n = needs(cmd)
    assert n and n.apt == ("unzip",) and n.apt_update and n.pip == () and n.fetches == ()
    assert n.parts == ("sudo -S apt-get update -y", "sudo -S apt-get install unzip -y")
    assert n.offline == f"{PW}true && {PW}true && unzip {zip_} -d /home/user/Desktop/ && rm {zip_}"


@pytest.mark.parametrize(("command", "apt", "update", "offline"), [
    # chrome/3299584d, chrome/9656a811
    (f"{PW}sudo -S apt update -y && {PW}sudo -S apt install jq -y", ("jq",), True, f"{PW}true && {PW}true"),
    # multi_apps/2373b66a (no -y)
    (f"{PW}sudo -S apt-get update && {PW}sudo -S apt-get install sysstat", ("sysstat",), True, f"{PW}true && {PW}true"),
    # multi_apps/716a6079: xsel is installed, then used
    (f"{PW}sudo -S apt install xsel && xsel -bc", ("xsel",), False, f"{PW}true && xsel -bc"),
    # os/5812b315 (postconfig)
    (f"{PW}sudo -S apt-get install -y expect", ("expect",), False, f"{PW}true"),
])
def test_osworld_apt_commands(command: str, apt: tuple[str, ...], update: bool, offline: str) -> None:
    n = needs(command)
    assert (n.apt, n.apt_update, n.pip, n.fetches, n.offline) == (apt, update, (), (), offline)


@pytest.mark.parametrize(("command", "shell", "package", "offline"), [
    (["pip", "install", "pygame"], False, "pygame", ["true"]),  # multi_apps/26150609
    (f"{PW}sudo -S pip install pysrt", True, "pysrt", f"{PW}true"),  # multi_apps/9f3bb592 (postconfig)
    ("pip install PyMuPDF", True, "PyMuPDF", "true"),  # multi_apps/da922383 (postconfig): imports as fitz
])
def test_osworld_pip_commands(command: str | list[str], shell: bool, package: str, offline: object) -> None:
    n = needs(command, shell)
    assert (n.apt, n.pip, n.fetches, n.offline) == ((), (PipPackage(package, PY3),), (), offline)


@pytest.mark.parametrize(("command", "shell"), [
    # thunderbird/d38192b0 (postconfig): a wheel the task downloaded
    (["pip", "install", "/home/user/cssselect-1.3.0-py3-none-any.whl"], False),
    (["apt", "list", "--installed"], False),  # multi_apps/e1fc0df3 (postconfig)
    # multi_apps/2c9fc0de: git with a local remote
    (["/bin/bash", "-c", "unzip -q /home/user/Downloads/binder.zip -d /home/user/projects/ && cd /home/user/projects/"
      "binder && git init --initial-branch main && git remote add origin /home/user/projects/remote_project"], False),
    # chrome/3299584d: a URL inside jq's program is not fetched
    ("cd /home/user/.config/google-chrome/Default && jq '. + {\"session\":{\"restore_on_startup\":4, "
     "\"startup_urls\":[\"http://funbrain.com/\"]}}' Preferences > temp && mv temp Preferences", True),
    # multi_apps/510f64c8: a local .vsix
    (["/bin/bash", "-c", "cd /home/user/Downloads && unzip -q vscodeEvalExtension.zip && code --install-extension "
      "vscodeEvalExtension/eval-0.0.1.vsix && rm -rf vscodeEvalExtension vscodeEvalExtension.zip"], False),
    ("pkill -f chromium; sleep 1", True),
])
def test_local_commands_need_nothing_and_stay_as_written(command: str | list[str], shell: bool) -> None:
    n = needs(command, shell)
    assert not n and n == NetworkNeeds(offline=command) and n.offline is command


@pytest.mark.skipif(not EXAMPLES.is_dir(), reason=f"OSWorld's examples are not at {EXAMPLES}")
def test_which_of_osworlds_369_tasks_use_the_network_in_a_command() -> None:
    found: dict[str, list[str]] = {}
    files = sorted(EXAMPLES.glob("*/*.json"))
    for f in files:
        task = json.loads(f.read_text())
        steps = [*task.get("config", []), *(task.get("evaluator", {}).get("postconfig") or [])]
        for step in steps:
            p = step.get("parameters") or {}
            if step.get("type") in ("execute", "command", "launch", "execute_with_verification") and "command" in p:
                n = network_needs(p["command"], bool(p.get("shell", False)))
                if n:
                    found.setdefault(f"{f.parent.name}/{f.stem[:8]}", []).extend(
                        [*n.apt, *(x.name for x in n.pip), *n.fetches])
    assert len(files) == 369
    assert found == {
        "chrome/3299584d": ["jq"], "chrome/6766f2b8": ["unzip"], "chrome/9656a811": ["jq"],
        "multi_apps/2373b66a": ["sysstat"], "multi_apps/26150609": ["pygame"], "multi_apps/716a6079": ["xsel"],
        "multi_apps/9f3bb592": ["pysrt"], "multi_apps/a74b607e": ["unzip"], "multi_apps/da922383": ["PyMuPDF"],
        "os/5812b315": ["expect"],
        "vs_code/e2b5e914": ["the VS Code extension ms-python.python (marketplace)"]}


# ---------------------------------------------------------------------------- shapes of commands


@pytest.mark.parametrize(("command", "shell", "apt"), [
    (["sudo", "-S", "apt-get", "install", "-y", "sysstat"], False, ("sysstat",)),
    ("sudo -E -u root DEBIAN_FRONTEND=noninteractive apt-get -o Dpkg::Use-Pty=0 -qq install --no-install-recommends "
     "jq=1.6-2.1 vim/bookworm", True, ("jq", "vim")),
    ("DEBIAN_FRONTEND=noninteractive env -i PATH=/usr/bin timeout -s KILL 60 nice -n 5 apt install -y a b", True,
     ("a", "b")),
    ("apt-get install -y x >/dev/null 2>&1 </dev/null", True, ("x",)),
    ("apt-get install -y x > /tmp/log 2> /tmp/err", True, ("x",)),
    ("aptitude install -y x", True, ("x",)),
    ("/usr/bin/apt-get install -y x", True, ("x",)),
])
def test_apt_seen_through_wrappers_options_and_redirections(command: str | list[str], shell: bool,
                                                             apt: tuple[str, ...]) -> None:
    n = needs(command, shell)
    assert n.apt == apt and n.pip == () and n.fetches == ()


@pytest.mark.parametrize(("command", "pip"), [
    ("python3 -m pip install --user requests", [PipPackage("requests", "python3")]),
    ("python -m pip install -U 'numpy>=1.2' pandas[excel]==2.0", [PipPackage("numpy", "python"),
                                                                  PipPackage("pandas", "python")]),
    ("pip3.11 install --quiet --index-url https://pypi.org/simple x", [PipPackage("x", "python3.11")]),
    ("/home/user/venv/bin/pip install x", [PipPackage("x", "/home/user/venv/bin/python3")]),
    ("pip --disable-pip-version-check install --upgrade pip", [PipPackage("pip", "python3")]),
    ("sudo -H pip3 install opencv-python-headless", [PipPackage("opencv-python-headless", "python3")]),
])
def test_pip_packages_and_their_interpreter(command: str, pip: list[PipPackage]) -> None:
    n = needs(command)
    assert list(n.pip) == pip and n.apt == () and n.fetches == () and n.offline == "true"


@pytest.mark.parametrize("command", [
    "pip uninstall -y x", "pip show PyMuPDF", "pip list", "pip install --no-index --find-links /home/user/w x",
    "pip install ./pkg", "pip install ~/x.tar.gz", "pip install file:///home/user/x.whl", "pip install -e .",
    "apt-get remove -y x", "apt purge x", "apt-cache policy x", "apt install ./local.deb", "dpkg -i /tmp/x.deb",
    "curl -s http://localhost:9222/json", "wget -q http://127.0.0.1:8080/x -O /tmp/x", "curl file:///etc/hostname",
    "git clone /home/user/projects/remote_project copy", "git -C /home/user/p pull", "git fetch origin",
    "echo 'apt-get install x && pip install y'", "# apt-get install x", "ls # ; apt-get install x",
    "echo \"curl https://example.org\"", "snap list", "npm run build",
    "code --install-extension /home/user/test.vsix", "code --list-extensions",
])
def test_local_commands(command: str) -> None:
    n = needs(command)
    assert not n and n.offline == command


@pytest.mark.parametrize(("command", "fetches"), [
    ("wget -q https://example.org/a.zip -O /tmp/a.zip && unzip /tmp/a.zip", ("https://example.org/a.zip (wget)",)),
    ("curl -fsSL https://get.example.sh | sh", ("https://get.example.sh (curl)",)),
    ("x=$(curl -s https://api.example.org/v1) && echo $x", ("https://api.example.org/v1 (curl)",)),
    ("git clone --depth 1 -b main https://github.com/a/b.git /home/user/b",
     ("https://github.com/a/b.git (git clone)",)),
    ("git clone git@github.com:a/b.git", ("git@github.com:a/b.git (git clone)",)),
    ("sudo snap install vlc", ("snap install vlc",)),
    ("npm install -g typescript", ("npm install -g typescript",)),
    ("code --install-extension ms-python.python", ("the VS Code extension ms-python.python (marketplace)",)),
    ("code --install-extension=a.b --install-extension /tmp/c.vsix", ("the VS Code extension a.b (marketplace)",)),
    ("sudo apt-get dist-upgrade -y", ("apt-get dist-upgrade",)),
    ("pip install -r /home/user/requirements.txt", ("pip install -r /home/user/requirements.txt",)),
    ("pip download x", ("pip download x",)),
    ("pip install git+https://github.com/a/b", ("git+https://github.com/a/b",)),
])
def test_fetches_nothing_installed_can_stand_in_for(command: str, fetches: tuple[str, ...]) -> None:
    n = needs(command)
    assert n and n.fetches == fetches


def test_separators_quotes_and_subshells() -> None:
    n = needs("cd /tmp; (apt-get install -y a) || echo 'x && apt-get install -y q' & pip install b\nwget https://e.org/f")
    assert n.apt == ("a",) and n.pip == (PipPackage("b", PY3),) and n.fetches == ("https://e.org/f (wget)",)
    assert n.offline == "cd /tmp; (true) || echo 'x && apt-get install -y q' & true\ntrue"
    # `&` inside a redirection is not a separator
    n = needs("apt-get install -y a 2>&1 | tee /tmp/log &> /dev/null")
    assert n.apt == ("a",) and n.offline == "true | tee /tmp/log &> /dev/null"
    # an unbalanced quote: read as plain words (the shell refuses it anyway)
    assert needs("apt-get install -y a 'b").apt == ("a", "'b")


def test_nested_shells() -> None:
    # an argv's script is rewritten in place: the local part still runs
    argv = ["/bin/bash", "-lc", "apt-get update && apt-get install -y a && touch /tmp/done", "name"]
    n = needs(argv, False)
    assert n.apt == ("a",) and n.apt_update and n.offline == ["/bin/bash", "-lc", "true && true && touch /tmp/done",
                                                             "name"]
    assert needs(["sudo", "-S", "sh", "-c", "pip install x"], False).offline == ["true"]
    # in a shell string, a script that is all network goes as a whole; a mixed one cannot be cut
    assert needs("bash -c 'apt-get update; apt-get install -y a' && ls").offline == "true && ls"
    n = needs("bash -c 'apt-get install -y a && touch /tmp/done' && pip install b")
    assert n.apt == ("a",) and n.pip == (PipPackage("b", PY3),) and n.offline is None
    # a script file is not opened; a list run with shell=True is its first element
    assert not needs(["bash", "/home/user/install.sh"], False)
    assert needs(["pip install x", "ignored"], True).offline == ["true", "ignored"]


def test_installs_that_mix_local_files_and_packages_cannot_be_cut() -> None:
    n = needs("pip install ./local.whl requests")
    assert n.pip == (PipPackage("requests", PY3),) and n.offline is None
    n = needs("apt-get install -y ./x.deb jq")
    assert n.apt == ("jq",) and n.offline is None


def test_not_a_command() -> None:
    n = network_needs({"not": "a command"}, False)  # type: ignore[arg-type]
    assert not n and n.offline == {"not": "a command"}
    assert not network_needs([], False) and not network_needs("", True)
