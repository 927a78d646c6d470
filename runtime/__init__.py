"""The runtime: model, adapters, adapter cache, scheduler, engine and CLI."""
