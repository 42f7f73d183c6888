"""Where a test run's time went, per test file, from the lines conftest.py appends to the file
TK_TEST_TIMES names ("<seconds> <phase> <outcome> <node id>", one a phase of a test).

    python3 scripts/test_times.py test_times.txt

Prints one line a file, in the order the files ran: tests begun, seconds (setup, call and
teardown), and how many failed (in any phase) or were skipped; then the totals.
"""
import sys


def summarize(lines):
    """[(file, tests, seconds, failed, skipped)] in the order the files first appear."""
    tests = {}  # node id -> [seconds, failed, skipped]
    for line in lines:
        parts = line.split(maxsplit=3)
        if len(parts) != 4:
            continue
        seconds, _, outcome, node = parts
        test = tests.setdefault(node.strip(), [0.0, False, False])
        test[0] += float(seconds)
        test[1] |= outcome == "failed"
        test[2] |= outcome == "skipped"
    files = {}
    for node, (seconds, failed, skipped) in tests.items():
        row = files.setdefault(node.split("::")[0], [0, 0.0, 0, 0])
        row[0] += 1
        row[1] += seconds
        row[2] += failed
        row[3] += skipped
    return [(name, *row) for name, row in files.items()]


def main(path):
    try:
        with open(path) as f:
            rows = summarize(f)
    except FileNotFoundError:
        print(f"no test times in {path}")
        return
    totals = ("total", *(sum(row[i] for row in rows) for i in range(1, 5)))
    width = max(len(row[0]) for row in rows + [totals])
    for name, tests, seconds, failed, skipped in rows + [totals]:
        print(f"{name:<{width}}  {tests:4d} tests  {seconds:7.1f} s  {failed} failed  {skipped} skipped")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "test_times.txt")
