//! End-to-end tests: the server in-process, driven by real NBD clients (qemu-io, qemu-img,
//! nbdinfo, nbdcopy, fio) and by a raw-socket client sending malformed traffic.
//!
//! A missing client binary fails the test with the apt package to install.

mod block_status;
mod common;
mod fio;
mod libnbd;
mod qemu;
mod raw_socket;
mod tls;
mod tls_raw;
