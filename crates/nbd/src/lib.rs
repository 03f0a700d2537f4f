//! NBD (Network Block Device) protocol codec and server for pmcache.
//!
//! - [`codec`]: the pure wire format — fixed newstyle handshake (`NBD_OPT_GO`, `INFO`,
//!   `LIST`, `ABORT`, `EXPORT_NAME`, `STRUCTURED_REPLY`, `STARTTLS`), request decoding and
//!   validation, simple and structured reply encoding. No I/O; never panics on any input; fuzzed.
//! - [`export`]: the [`Export`] trait the server serves (a `pmcache_block::BlockConn` per
//!   connection) and [`BlockSizes`]; a `pmcache_block::BlockError`'s errno is mapped to NBD
//!   error codes.
//! - [`server`]: TCP (loopback unless `allow_remote`) or unix-socket listener, one thread
//!   per connection with pipelined requests, connection limit, bounded buffers, clean
//!   shutdown through a [`ShutdownHandle`].
//! - [`tls`]: TLS after `NBD_OPT_STARTTLS` (X.509 through rustls, PSK through OpenSSL):
//!   credentials, the acceptor, the encrypted stream.
//! - [`mem`]: [`MemExport`], a RAM-backed export for tests, examples and benchmarks.
//!
//! The protocol is documented in `docs/NBD.md` at the repository root.

#![forbid(unsafe_code)]

pub mod codec;
pub mod export;
pub mod mem;
pub mod server;
pub mod tls;

pub use codec::TlsMode;
pub use export::{BlockSizes, Export, extent_flags};
pub use mem::{MemExport, MemStats};
pub use server::{
    ConnEnd, ConnError, ListenAddr, ReplayTransport, RunningServer, Server, ServerConfig,
    ServerError, ServerStats, ShutdownHandle, Transport, serve_connection, serve_connection_tls,
};
pub use tls::{ConnTls, TlsAcceptor, TlsConfig, TlsError, TlsStream};
