"""The draft network: nothing about decoding lives here."""
