"""A stand-in for `journalctl -k -o json [--follow] [--after-cursor=C | --lines=0|all]`.

systemd-journald is not running where the tests run (CI containers have no systemd), so the
tests put this script on PATH as `journalctl`. It serves a "journal" that is a JSON-lines file of
real journald entries (path in $FAKE_JOURNAL): entries after the cursor, or none/all, then, with
--follow, each entry appended to the file later — what journalctl prints for the same journal.
$FAKE_JOURNALCTL_EXIT=N makes it print an error and exit N instead (a broken journal).
"""

import json
import os
import sys
import time


def main() -> int:
    args = sys.argv[1:]
    if os.environ.get("FAKE_JOURNALCTL_EXIT"):
        print("Failed to open journal: No such file or directory", file=sys.stderr)
        return int(os.environ["FAKE_JOURNALCTL_EXIT"])
    if "-k" not in args or args[args.index("-o") + 1] != "json":
        print("fake journalctl: expected -k -o json", file=sys.stderr)
        return 2
    follow = "--follow" in args or "-f" in args
    cursor = next((a.split("=", 1)[1] for a in args if a.startswith("--after-cursor=")), None)
    lines_arg = next((a.split("=", 1)[1] for a in args if a.startswith("--lines=")), "all")
    path = os.environ["FAKE_JOURNAL"]
    with open(path, "rb") as fh:
        existing = fh.read()
    pos = len(existing)
    entries = [json.loads(l) for l in existing.splitlines() if l.strip()]
    if cursor is not None:
        cursors = [e.get("__CURSOR") for e in entries]
        if cursor not in cursors:
            print("Failed to seek to cursor: Invalid argument", file=sys.stderr)
            return 1
        entries = entries[cursors.index(cursor) + 1 :]
    elif lines_arg == "0":
        entries = []
    for e in entries:
        sys.stdout.write(json.dumps(e) + "\n")
    sys.stdout.flush()
    with open(path + ".ready", "w") as fh:  # tests append only after this: --lines=0 means "from now"
        fh.write(str(os.getpid()))
    while follow:
        time.sleep(0.02)
        with open(path, "rb") as fh:
            fh.seek(pos)
            data = fh.read()
        complete = data[: data.rfind(b"\n") + 1]
        pos += len(complete)
        for line in complete.splitlines():
            if line.strip():
                sys.stdout.write(line.decode() + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
