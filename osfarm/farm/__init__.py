"""The farm service: warm pool and leases, REST API, auth, metrics."""
