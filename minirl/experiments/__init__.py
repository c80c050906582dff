"""Experiments over real runs. `python -m minirl.experiments.sweep` compares failure policies and drop
budgets on identical, seeded fault streams (grid.py: the cells; cells.py: running them; estimates.py,
questions.py, report.py, plots.py: what the report says and draws). Each cell is a `python -m
minirl.train` subprocess, so nothing here reaches into a run's internals."""
