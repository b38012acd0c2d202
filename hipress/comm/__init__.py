"""The communication wing: everything that moves bytes between ranks.

    discovery    what the launcher told this process (before any connection)
    transport/   the byte-buffer Transport interface and its registry of backends
    rendezvous   the torch Store for the backends that need one
    world        init / rank / size, the world, local and cross transports (host grouping)
    exchange     the Exchange interface strategies use (direct, coordinated)
    coordinator/ the global coordinator (slots over non-conflicting links, planned ahead)

Nothing outside this package imports a transport backend (tests/unit/test_layering.py).
"""
