"""The agent runtime: prompt assembly, the turn loop, provenance, and the model backends it drives."""
