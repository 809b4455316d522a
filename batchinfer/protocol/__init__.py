"""The wire formats, version 1 (docs/protocol.md): intake entries, request bodies, batch entries and
result rows. Pure data and validation: nothing here touches Redis."""
