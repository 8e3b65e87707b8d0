"""The provenance graph, observation log and checkpoint set the revocation operator works over."""
