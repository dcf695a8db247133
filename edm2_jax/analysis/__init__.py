"""Analysis: reading runs and programs. The training dynamics of runs (plots and
comparisons of the diagnostics the training loop logs, `diagnostics.py`; Sec. 2, Figures
2-3); the precision policy and its audit of a traced or compiled program's convolutions
and matmuls (`precision.py`).
"""
