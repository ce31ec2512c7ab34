"""HTTP pieces every layer shares (the in-box guest server, the farm, the clients): bearer-token
auth and reading an error reply. Layer-neutral: it imports nothing from osfarm."""
