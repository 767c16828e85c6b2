"""Helpers the tests share: sandboxes, real services, fixtures on disk, an OpenAI-shaped stub endpoint."""
