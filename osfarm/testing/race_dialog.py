"""A Tk dialog that races a click against the typing after it, for the settle timing's test and
bench/action_timing.py (run with the desktop's own ``python3``: ``python3 -c TK_RACE_DIALOG STATE DELAY_MS``).

It has a "Find" and a "Replace" field and moves the keyboard focus to "Replace" ``DELAY_MS`` after
a click on it, like an app whose click handling takes a moment (LibreOffice's Find & Replace under
load). It writes ``{"find", "replace", "at", "find_at"}`` (the fields' texts and centres) to STATE
after each key; creating ``STATE.reset`` empties both fields and gives "Find" the focus.
"""

TK_RACE_DIALOG = r"""
import json, os, sys, tkinter as tk
STATE, DELAY = sys.argv[1], int(sys.argv[2])
root = tk.Tk(); root.title("Tk Find and Replace"); root.geometry("+40+40")
tk.Label(root, text="Find").grid(row=0, column=0); tk.Label(root, text="Replace").grid(row=1, column=0)
find, repl = tk.Entry(root, width=30), tk.Entry(root, width=30)
find.grid(row=0, column=1, padx=8, pady=8); repl.grid(row=1, column=1, padx=8, pady=8)
def geom(w):
    root.update_idletasks()
    return {"x": w.winfo_rootx() + w.winfo_width() // 2, "y": w.winfo_rooty() + w.winfo_height() // 2}
def save(*_):
    with open(STATE + ".tmp", "w") as f:
        json.dump({"find": find.get(), "replace": repl.get(), "at": geom(repl), "find_at": geom(find)}, f)
    os.replace(STATE + ".tmp", STATE)
def clicked(_):  # the focus follows the click only once the app got round to it
    root.after(DELAY, repl.focus_set)
    return "break"
def reset():
    if os.path.exists(STATE + ".reset"):
        os.unlink(STATE + ".reset")
        find.delete(0, "end"); repl.delete(0, "end"); find.focus_force(); save()
    root.after(20, reset)
repl.bind("<Button-1>", clicked)
root.bind_all("<KeyRelease>", save)
root.after(200, save); root.after(20, reset)
root.mainloop()
"""
