"""`sandboxd mcp`: a sandboxd session served to any MCP client (stdio or streamable HTTP).

`server` assembles the MCP server and its transports, `session` bridges MCP calls to the daemon
(through `sandboxd.client.Client` only), `retries` decides which call a retry repeats, `provenance`
and `revocation` keep the session's graph and take its revocations, `tools` maps manifests and
results to MCP.
"""
