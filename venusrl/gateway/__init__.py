"""The gateway: OpenAI- and Anthropic-compatible endpoints that an unmodified agent harness talks
to while `venusrl train` records, per session, the exact tokens in and out (`harness`)."""
