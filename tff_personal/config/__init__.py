"""The typed description of a run: `ExperimentConfig` and its resolution,
the `RunSpec` file form, the evaluation strategies, and the algorithm x task
matrix. Above the algorithms and tasks, below everything that runs one.
"""
