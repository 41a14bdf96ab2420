"""What tools/bench_quality.py and tools/quality_summary.py still import from here until they move to bench/
(issue 29, another helper's part): the library's report helpers. Delete this file with that move; every other
benchmark uses bench/core.py."""

from distsparse.report import add_json_arg, machine_info, print_table, write_json  # noqa: F401
