"""Running and opening runs: training, the `Run` handle, analysis of a
finished run, export for devices, and the `tff.program` training program.
"""
