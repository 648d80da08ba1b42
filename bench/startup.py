"""CPU seconds of the command's answers that need no model: `tlm train --help`, `tlm --help` and an argument
error (`tlm train --lr -1`), each in a new interpreter, against `import torch` alone (what every one of them
paid before the command parsed its arguments first: issue 26). The ratio is the command's cost in imports of
torch; below 1, it answers without one.

    python bench/startup.py [--repeat 5]       # one JSON line per row: median CPU seconds (user + sys), ratio
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys

ROWS = {
    "tlm train --help": ["-m", "tlm", "train", "--help"],
    "tlm --help": ["-m", "tlm", "--help"],
    "tlm train --lr -1": ["-m", "tlm", "train", "--lr", "-1"],
}
REFERENCE = ["-c", "import torch"]


def cpu_seconds(argv: list[str]) -> float:
    """User + system CPU seconds of ``python argv`` (its exit status is not checked: an error is a row too)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, *argv], capture_output=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    reference = statistics.median(cpu_seconds(REFERENCE) for _ in range(args.repeat))
    print(json.dumps({"row": "import torch (reference)", "cpu_s": round(reference, 3)}), flush=True)
    for name, argv in ROWS.items():
        seconds = statistics.median(cpu_seconds(argv) for _ in range(args.repeat))
        print(json.dumps({"row": name, "cpu_s": round(seconds, 3), "vs_import_torch": round(seconds / reference, 3)}))


if __name__ == "__main__":
    main()
