"""`sandboxd console`: a web console for operators, over the same client and protocol as the CLI."""
