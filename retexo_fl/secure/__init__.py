"""End-to-end encryption of what clients send each other through the server's relay."""
