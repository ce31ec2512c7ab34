"""Writes the task JSONs, their reference solutions and test_all.json of this suite (run after
generate_assets.py).  python build_tasks.py"""
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_assets as g
S = Path(__file__).resolve().parent
URL = "https://osfarm.invalid/offline/{}/{}"
index = {}

def write(domain, tid, instruction, config, evaluator, steps, apps, source="osfarm-offline"):
    (S / domain / "solutions").mkdir(parents=True, exist_ok=True)
    task = {"id": tid, "snapshot": domain, "instruction": instruction, "source": source,
            "config": config, "trajectory": f"solutions/{tid}.json", "related_apps": apps,
            "evaluator": evaluator, "proxy": False, "fixed_ip": False, "possibility_of_env_change": "low"}
    (S / domain / f"{tid}.json").write_text(json.dumps(task, indent=2) + "\n")
    (S / domain / "solutions" / f"{tid}.json").write_text(json.dumps(steps, indent=1) + "\n")
    index.setdefault(domain, []).append(tid)

def dl(tid, name, dest):
    return {"type": "download", "parameters": {"files": [{"url": URL.format(tid, name), "path": dest}]}}

TERM = [{"type": "launch", "parameters": {"command": ["xfce4-terminal", "--disable-server"]}},
        {"type": "activate_window", "parameters": {"window_name": "xfce4-terminal", "by_class": True}}]

def typed(cmd):
    return [f"pyautogui.write({cmd!r}, interval=0.01)", "pyautogui.press('enter')"]

def cmdline(shell_cmd):
    return {"type": "vm_command_line", "command": shell_cmd, "shell": True}

def poll(cond, n=50):
    return f"for i in $(seq {n}); do {cond} && break; sleep 0.1; done; "

# ---------------- os ----------------
t = g.OS_COUNT
write("os", t, "Count the lines of ~/Desktop/notes.txt in a terminal and write just the number into ~/Desktop/count.txt.",
      [dl(t, "notes.txt", "/home/user/Desktop/notes.txt")] + TERM,
      {"func": "exact_match", "result": cmdline(poll("[ -s /home/user/Desktop/count.txt ]") + "tr -d ' \\n' < /home/user/Desktop/count.txt"),
       "expected": {"type": "rule", "rules": {"expected": "37"}}},
      [typed("wc -l < ~/Desktop/notes.txt > ~/Desktop/count.txt"), ["DONE"]], ["terminal"])
t = g.OS_RENAME
write("os", t, "Rename draft.txt on the Desktop to final_report.txt.",
      [dl(t, "draft.txt", "/home/user/Desktop/draft.txt")] + TERM,
      {"func": "check_include_exclude", "result": cmdline(poll("[ -e /home/user/Desktop/final_report.txt ]") + "ls /home/user/Desktop"),
       "expected": {"type": "rule", "rules": {"include": ["final_report.txt"], "exclude": ["draft.txt"]}}},
      [typed("mv ~/Desktop/draft.txt ~/Desktop/final_report.txt"), ["DONE"]], ["terminal"])
t = g.OS_CHMOD
write("os", t, "Make the script ~/run.sh executable by its owner, then run it once.",
      [dl(t, "run.sh", "/home/user/run.sh")] + TERM,
      {"func": "exact_match", "result": cmdline(poll("[ -x /home/user/run.sh ]") + "[ -x /home/user/run.sh ] && printf yes || printf no"),
       "expected": {"type": "rule", "rules": {"expected": "yes"}}},
      [typed("chmod u+x ~/run.sh && ~/run.sh"), ["DONE"]], ["terminal"])
t = g.OS_COPYCSV
write("os", t, "Copy every .csv file from ~/data into a new folder ~/backup (leave other files alone).",
      [dl(t, n, f"/home/user/data/{n}") for n in ("a.csv", "b.csv", "c.txt")] + TERM,
      {"func": "check_include_exclude", "result": cmdline(poll("[ -e /home/user/backup/b.csv ]") + "ls /home/user/backup; echo ---; ls /home/user/data"),
       "expected": {"type": "rule", "rules": {"include": ["a.csv\nb.csv\n---\na.csv\nb.csv\nc.txt"], "exclude": ["c.txt\n---"]}}},
      [typed("mkdir -p ~/backup && cp ~/data/*.csv ~/backup/"), ["DONE"]], ["terminal"])
t = g.OS_TAR
write("os", t, "Pack the folder ~/docs into a gzip-compressed tar archive ~/docs.tar.gz.",
      [dl(t, n, f"/home/user/docs/{n}") for n in ("one.txt", "two.txt")] + TERM,
      {"func": "check_include_exclude", "result": cmdline(poll("tar tzf /home/user/docs.tar.gz >/dev/null 2>&1") + "tar tzf /home/user/docs.tar.gz"),
       "expected": {"type": "rule", "rules": {"include": ["docs/one.txt", "docs/two.txt"], "exclude": []}}},
      [typed("cd ~ && tar czf docs.tar.gz docs"), ["DONE"]], ["terminal"])
t = g.OS_SORT
write("os", t, "Sort the names in ~/names.txt alphabetically, in place.",
      [dl(t, "names.txt", "/home/user/names.txt")] + TERM,
      {"func": "exact_match", "result": cmdline(poll("head -1 /home/user/names.txt | grep -qx alice") + "tr '\\n' ' ' < /home/user/names.txt"),
       "expected": {"type": "rule", "rules": {"expected": "alice bob carol mallory trent "}}},
      [typed("sort -o ~/names.txt ~/names.txt"), ["DONE"]], ["terminal"])


t = g.OS_MOUSEPAD
write("os", t, "Open ~/Desktop/todo.txt in the Mousepad text editor, add a last line \"water the plants\" and save it.",
      [dl(t, "todo.txt", "/home/user/Desktop/todo.txt"),
       {"type": "execute", "parameters": {"command": "touch /tmp/.osfarm_t0_" + t, "shell": True}},
       {"type": "launch", "parameters": {"command": ["mousepad", "/home/user/Desktop/todo.txt"]}},
       {"type": "execute", "parameters": {"command": poll("wmctrl -l | grep -q todo.txt", 150) + "true", "shell": True}},
       {"type": "activate_window", "parameters": {"window_name": "todo.txt"}}],
      {"postconfig": [{"type": "execute", "parameters": {"command": poll("[ /home/user/Desktop/todo.txt -nt /tmp/.osfarm_t0_" + t + " ]", 100) + "true", "shell": True}}],
       "func": "compare_text_file", "result": {"type": "vm_file", "path": "/home/user/Desktop/todo.txt", "dest": "todo.txt"},
       "expected": {"type": "cloud_file", "path": URL.format(t, "todo_gold.txt"), "dest": "todo_gold.txt"}},
      [["pyautogui.hotkey('ctrl', 'end')"], ["pyautogui.write('water the plants\\n', interval=0.01)"], ["pyautogui.hotkey('ctrl', 's')"], ["DONE"]],
      ["mousepad"])


t = g.OS_SED
write("os", t, "In ~/app.conf, change the port from 8080 to 9090 without touching the other settings.",
      [dl(t, "app.conf", "/home/user/app.conf")] + TERM,
      {"func": "exact_match", "result": cmdline(poll("grep -q 9090 /home/user/app.conf") + "tr '\\n' ' ' < /home/user/app.conf"),
       "expected": {"type": "rule", "rules": {"expected": "name=demo port=9090 debug=true "}}},
      [typed("sed -i 's/^port=8080$/port=9090/' ~/app.conf"), ["DONE"]], ["terminal"])
t = g.OS_LINK
write("os", t, "Create a symbolic link ~/latest.txt that points to ~/releases/v2.txt.",
      [dl(t, "v2.txt", "/home/user/releases/v2.txt")] + TERM,
      {"func": "exact_match", "result": cmdline(poll("[ -L /home/user/latest.txt ]") + "printf %s \"$(readlink -f /home/user/latest.txt)\""),
       "expected": {"type": "rule", "rules": {"expected": "/home/user/releases/v2.txt"}}},
      [typed("ln -s ~/releases/v2.txt ~/latest.txt"), ["DONE"]], ["terminal"])

# ---------------- office ----------------
def office(domain, app, tid, name, gold, instruction, edit_steps, func, options=None, ext_apps=None):
    path = f"/home/user/{name}"
    marker = f"/tmp/.osfarm_t0_{tid}"
    ev = {"postconfig": [{"type": "execute", "parameters": {"command": poll(f"[ {path} -nt {marker} ]", 150) + "sleep 1", "shell": True}}],
          "func": func,
          "result": {"type": "vm_file", "path": path, "dest": name},
          "expected": {"type": "cloud_file", "path": URL.format(tid, gold), "dest": gold}}
    if options:
        ev["options"] = options
    cfg = [dl(tid, name, path),
           {"type": "execute", "parameters": {"command": f"touch {marker}", "shell": True}},
           ({"type": "open", "parameters": {"path": path}} if domain == "libreoffice_calc" else
            {"type": "launch", "parameters": {"command": ["soffice", "--writer" if domain == "libreoffice_writer" else "--impress", path]}}),
           {"type": "execute", "parameters": {"command": poll(f"[ -e '/home/user/.~lock.{name}#' ]", 150) + poll("wmctrl -l | grep -q 'Tip of the Day'", 150) + "wmctrl -c 'Tip of the Day'; sleep 0.5", "shell": True}},
           {"type": "activate_window", "parameters": {"window_name": name}}]
    steps = edit_steps + [["pyautogui.hotkey('ctrl', 's')"], ["pyautogui.press('enter')"], ["DONE"]]
    write(domain, tid, instruction, cfg, ev, steps, [app])

office("libreoffice_calc", "libreoffice_calc", g.CALC_SUM, "sales.xlsx", "sales_gold.xlsx",
       "In sales.xlsx, put the total of the Units column in cell B7 (just below the data) and save the file, keeping its format.",
       [["pyautogui.click(66, 142)"], ["pyautogui.write('B7\\n', interval=0.01)"], [
         "pyautogui.write('=SUM(B2:B6)\\n', interval=0.01)"]], "compare_table")
office("libreoffice_calc", "libreoffice_calc", g.CALC_PRODUCT, "revenue.xlsx", "revenue_gold.xlsx",
       "Add a column D titled \"Revenue\" holding Units times Price for every region of revenue.xlsx, then save it in its current format.",
       [["pyautogui.click(66, 142)"], ["pyautogui.write('D1\\n', interval=0.01)"], [
         "pyautogui.write('Revenue\\n', interval=0.01)"] +
        [f"pyautogui.write('=B{r}*C{r}\\n', interval=0.01)" for r in range(2, 7)]], "compare_table")
office("libreoffice_calc", "libreoffice_calc", g.CALC_AVG, "prices.xlsx", "prices_gold.xlsx",
       "In prices.xlsx, write the average Price of the five regions into cell C7 and save the file (keep the xlsx format).",
       [["pyautogui.click(66, 142)"], ["pyautogui.write('C7\\n', interval=0.01)"], [
         "pyautogui.write('=AVERAGE(C2:C6)\\n', interval=0.01)"]], "compare_table")
office("libreoffice_calc", "libreoffice_calc", g.CALC_MAX, "units.xlsx", "units_gold.xlsx",
       "In units.xlsx, put the largest value of the Units column into cell E1 and save the file as xlsx.",
       [["pyautogui.click(66, 142)"], ["pyautogui.write('E1\\n', interval=0.01)"], ["pyautogui.write('=MAX(B2:B6)\\n', interval=0.01)"]], "compare_table")
t = "0f5d2a10-0000-4000-8000-000000000401"
write("chrome", t, "Open the local page ~/Desktop/welcome.html in the browser.",
      [dl(t, "welcome.html", "/home/user/Desktop/welcome.html"),
       {"type": "launch", "parameters": {"command": ["google-chrome", "--remote-debugging-port=1337"]}},
       {"type": "launch", "parameters": {"command": ["socat", "tcp-listen:9222,fork", "tcp:localhost:1337"]}},
       {"type": "execute", "parameters": {"command": poll("wmctrl -l | grep -qi chrom", 150) + "true", "shell": True}}],
      {"func": "is_expected_active_tab", "result": {"type": "active_tab_info"},
       "expected": {"type": "rule", "rules": {"type": "url", "url": "file:///home/user/Desktop/welcome.html"}}},
      [["pyautogui.hotkey('ctrl', 'l')"], ["pyautogui.write('file:///home/user/Desktop/welcome.html\\n', interval=0.01)"], ["DONE"]],
      ["chrome"])

# ---------------- infeasible ----------------
for tid, dom, instr in [
    ("0f5d2a10-0000-4000-8000-000000000901", "os", "Pair my Bluetooth headphones named 'SoundCore Q30' with this computer."),
    ("0f5d2a10-0000-4000-8000-000000000902", "libreoffice_calc", "In LibreOffice Calc, use the built-in ChatGPT button to summarise my spreadsheet into a poem."),
    ("0f5d2a10-0000-4000-8000-000000000903", "chrome", "Install the Internet Explorer 6 rendering engine into the browser so old intranet pages display correctly."),
]:
    write(dom, tid, instr, [], {"func": "infeasible"}, [["FAIL"]], [], "osfarm-offline (infeasible)")

(S / "test_all.json").write_text(json.dumps(index, indent=2) + "\n")
print({k: len(v) for k, v in index.items()})
