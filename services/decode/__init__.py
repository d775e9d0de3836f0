"""The decode service: HTTP front of one inference engine replica (`python -m services.decode`)."""
