"""The evaluator: a run's personalized evaluation with its named
strategies, and new-user (cold-start) evaluation.
"""
