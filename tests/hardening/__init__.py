"""Hardening tests: kills and reruns, S3 faults, a bad-input corpus, loader faults, secrets."""
