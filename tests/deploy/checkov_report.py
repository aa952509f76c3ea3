"""Reads checkov's JSON report: fails on any failed check, and on any skip
that does not say why, so each accepted finding stays justified where it is
declared (the checkov.io/skipN annotations).

usage: checkov -o json ... | checkov_report.py
"""

import json
import sys


def main():
    reports = json.load(sys.stdin)
    failed, unexplained = 0, 0
    for report in reports if isinstance(reports, list) else [reports]:
        results = report.get("results", {})
        for check in results.get("failed_checks", []):
            failed += 1
            print(f"FAILED {check['check_id']} {check['check_name']} in {check['file_path']} {check['resource']}")
        for check in results.get("skipped_checks", []):
            reason = (check.get("check_result") or {}).get("suppress_comment", "").strip()
            unexplained += not reason
            print(f"skipped {check['check_id']} in {check['file_path']}: {reason or 'NO REASON GIVEN'}")
    print(f"checkov: {failed} failed, {unexplained} skips without a reason")
    return 1 if failed or unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
