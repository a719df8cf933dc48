"""qflow's command-line entry points (installed as ``qflow.cli``)."""
