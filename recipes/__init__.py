"""torchtune recipes of dualkv_compile, run by path: PYTHONPATH=. tune run recipes/<file>.py --config ...

A regular package, so that it takes precedence over the top-level `recipes` package that
torchtune 0.6.1's wheel installs (which raises on import) once the repo root leads the path.
"""
