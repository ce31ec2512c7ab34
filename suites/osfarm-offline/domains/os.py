"""os: shell and file tasks done in a terminal, and one in the Mousepad editor."""
from suitekit import (
    DONE,
    TERM,
    activate,
    cmdline,
    dl,
    gold,
    hotkey,
    launch,
    mark,
    poll,
    rule,
    saved_after_mark,
    type_text,
    typed,
    vm_file,
    wait_window,
)

COUNT = "0f5d2a10-0000-4000-8000-000000000001"
RENAME = "0f5d2a10-0000-4000-8000-000000000002"
CHMOD = "0f5d2a10-0000-4000-8000-000000000003"
COPYCSV = "0f5d2a10-0000-4000-8000-000000000004"
TAR = "0f5d2a10-0000-4000-8000-000000000005"
SORT = "0f5d2a10-0000-4000-8000-000000000006"
MOUSEPAD = "0f5d2a10-0000-4000-8000-000000000007"
SED = "0f5d2a10-0000-4000-8000-000000000008"
LINK = "0f5d2a10-0000-4000-8000-000000000009"
GREP = "0f5d2a10-0000-4000-8000-000000000010"
H = "/home/user"


def build(kit) -> None:
    kit.text(COUNT, "notes.txt", "".join(f"note number {i}\n" for i in range(1, 38)))
    kit.task("os", COUNT, "Count the lines of ~/Desktop/notes.txt in a terminal and write just the number into "
             "~/Desktop/count.txt.",
             [dl(COUNT, "notes.txt", f"{H}/Desktop/notes.txt")] + TERM,
             {"func": "exact_match",
              "result": cmdline(poll(f"[ -s {H}/Desktop/count.txt ]") + f"tr -d ' \\n' < {H}/Desktop/count.txt"),
              "expected": rule(expected="37")},
             [typed("wc -l < ~/Desktop/notes.txt > ~/Desktop/count.txt"), DONE], ["terminal"])

    kit.text(RENAME, "draft.txt", "draft of the annual report\n")
    kit.task("os", RENAME, "Rename draft.txt on the Desktop to final_report.txt.",
             [dl(RENAME, "draft.txt", f"{H}/Desktop/draft.txt")] + TERM,
             {"func": "check_include_exclude",
              "result": cmdline(poll(f"[ -e {H}/Desktop/final_report.txt ]") + f"ls {H}/Desktop"),
              "expected": rule(include=["final_report.txt"], exclude=["draft.txt"])},
             [typed("mv ~/Desktop/draft.txt ~/Desktop/final_report.txt"), DONE], ["terminal"])

    kit.text(CHMOD, "run.sh", "#!/bin/sh\necho running\n")
    kit.task("os", CHMOD, "Make the script ~/run.sh executable by its owner, then run it once.",
             [dl(CHMOD, "run.sh", f"{H}/run.sh")] + TERM,
             {"func": "exact_match",
              "result": cmdline(poll(f"[ -x {H}/run.sh ]") + f"[ -x {H}/run.sh ] && printf yes || printf no"),
              "expected": rule(expected="yes")},
             [typed("chmod u+x ~/run.sh && ~/run.sh"), DONE], ["terminal"])

    for n in ("a.csv", "b.csv", "c.txt"):
        kit.text(COPYCSV, n, f"col1,col2\n{n},1\n")
    kit.task("os", COPYCSV, "Copy every .csv file from ~/data into a new folder ~/backup (leave other files alone).",
             [dl(COPYCSV, n, f"{H}/data/{n}") for n in ("a.csv", "b.csv", "c.txt")] + TERM,
             {"func": "check_include_exclude",
              "result": cmdline(poll(f"[ -e {H}/backup/b.csv ]") + f"ls {H}/backup; echo ---; ls {H}/data"),
              "expected": rule(include=["a.csv\nb.csv\n---\na.csv\nb.csv\nc.txt"], exclude=["c.txt\n---"])},
             [typed("mkdir -p ~/backup && cp ~/data/*.csv ~/backup/"), DONE], ["terminal"])

    for n in ("one.txt", "two.txt"):
        kit.text(TAR, n, f"content of {n}\n")
    kit.task("os", TAR, "Pack the folder ~/docs into a gzip-compressed tar archive ~/docs.tar.gz.",
             [dl(TAR, n, f"{H}/docs/{n}") for n in ("one.txt", "two.txt")] + TERM,
             {"func": "check_include_exclude",
              "result": cmdline(poll(f"tar tzf {H}/docs.tar.gz >/dev/null 2>&1") + f"tar tzf {H}/docs.tar.gz"),
              "expected": rule(include=["docs/one.txt", "docs/two.txt"], exclude=[])},
             [typed("cd ~ && tar czf docs.tar.gz docs"), DONE], ["terminal"])

    kit.text(SORT, "names.txt", "mallory\nalice\ntrent\nbob\ncarol\n")
    kit.task("os", SORT, "Sort the names in ~/names.txt alphabetically, in place.",
             [dl(SORT, "names.txt", f"{H}/names.txt")] + TERM,
             {"func": "exact_match",
              "result": cmdline(poll(f"head -1 {H}/names.txt | grep -qx alice") + f"tr '\\n' ' ' < {H}/names.txt"),
              "expected": rule(expected="alice bob carol mallory trent ")},
             [typed("sort -o ~/names.txt ~/names.txt"), DONE], ["terminal"])

    kit.text(MOUSEPAD, "todo.txt", "buy milk\ncall the bank\n")
    kit.text(MOUSEPAD, "todo_gold.txt", "buy milk\ncall the bank\nwater the plants\n")
    kit.task("os", MOUSEPAD, "Open ~/Desktop/todo.txt in the Mousepad text editor, add a last line "
             "\"water the plants\" and save it.",
             [dl(MOUSEPAD, "todo.txt", f"{H}/Desktop/todo.txt"), mark(MOUSEPAD),
              launch("mousepad", f"{H}/Desktop/todo.txt"), wait_window("todo.txt"), activate("todo.txt")],
             {"postconfig": [saved_after_mark(MOUSEPAD, f"{H}/Desktop/todo.txt", 100)],
              "func": "compare_text_file", "result": vm_file(f"{H}/Desktop/todo.txt"),
              "expected": gold(MOUSEPAD, "todo_gold.txt")},
             [hotkey("ctrl", "end"), type_text("water the plants\n"), hotkey("ctrl", "s"), DONE], ["mousepad"])

    kit.text(SED, "app.conf", "name=demo\nport=8080\ndebug=true\n")
    kit.task("os", SED, "In ~/app.conf, change the port from 8080 to 9090 without touching the other settings.",
             [dl(SED, "app.conf", f"{H}/app.conf")] + TERM,
             {"func": "exact_match",
              "result": cmdline(poll(f"grep -q 9090 {H}/app.conf") + f"tr '\\n' ' ' < {H}/app.conf"),
              "expected": rule(expected="name=demo port=9090 debug=true ")},
             [typed("sed -i 's/^port=8080$/port=9090/' ~/app.conf"), DONE], ["terminal"])

    kit.text(LINK, "v2.txt", "release notes v2\n")
    kit.task("os", LINK, "Create a symbolic link ~/latest.txt that points to ~/releases/v2.txt.",
             [dl(LINK, "v2.txt", f"{H}/releases/v2.txt")] + TERM,
             {"func": "exact_match",
              "result": cmdline(poll(f"[ -L {H}/latest.txt ]") + f"printf %s \"$(readlink -f {H}/latest.txt)\""),
              "expected": rule(expected=f"{H}/releases/v2.txt")},
             [typed("ln -s ~/releases/v2.txt ~/latest.txt"), DONE], ["terminal"])

    logs = {"app.log": "INFO start\nINFO ready\n", "db.log": "INFO connect\nERROR disk quota exceeded\n",
            "web.log": "INFO GET /\nWARN slow request\n", "mail.log": "ERROR relay refused\nINFO retry\n"}
    for n, body in logs.items():
        kit.text(GREP, n, body)
    kit.task("os", GREP, "Some files in ~/logs contain the word ERROR. Write their names (file names only, one per "
             "line, sorted) into ~/errors.txt.",
             [dl(GREP, n, f"{H}/logs/{n}") for n in logs] + TERM,
             {"func": "exact_match",
              "result": cmdline(poll(f"[ -s {H}/errors.txt ]") + f"tr '\\n' ' ' < {H}/errors.txt"),
              "expected": rule(expected="db.log mail.log ")},
             [typed("cd ~/logs && grep -l ERROR *.log | sort > ~/errors.txt"), DONE], ["terminal"])
