"""The stateful facade users touch: Net, solvers, data layers' readers."""
