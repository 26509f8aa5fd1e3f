"""Integrations with other libraries; each is an optional extra, imported on demand."""
