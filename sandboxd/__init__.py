"""sandboxd: a tool-execution firewall for LLM agents."""

__version__ = "0.1.0"
