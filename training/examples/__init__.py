"""Training scripts that use Relay's public worker API, and nothing else of Relay's."""
