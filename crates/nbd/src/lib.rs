//! NBD protocol codec and server (stub; being written).
