"""Stand-ins for servers the tests cannot run here; each is named a stand-in wherever it is used."""
