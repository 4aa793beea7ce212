"""What a run directory records, and reading it back: the run's config
record, its lock, and its privacy record and report. Below the evaluator,
which reads them.
"""
