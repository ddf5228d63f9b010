"""Wire types shared by every service; no I/O here. Wire messages are versioned msgspec Structs."""
