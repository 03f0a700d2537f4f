//! End-to-end tests of `pmcache serve` and the management commands: the real `pmcache`
//! binary as a child process (cache medium in /dev/shm, sparse backing file in a temp dir,
//! ephemeral TCP port or unix socket, control socket in the temp dir), driven by real NBD
//! clients (qemu-io, qemu-img, nbdinfo, nbdcopy, fio) and by raw-socket clients, including
//! kill -9 of the server mid-write and recovery on restart, and the write-back at a stop on a
//! volatile medium with the refusal to start over a backing store whose cache was lost (also
//! after a run-time switch to write-back), a detach after which the backing store's own
//! writes are served, and the kinds of medium (a disk file refused, or served in msync mode), block status and
//! oversized requests, a soak with stalled and misbehaving clients beside 16 verifying ones,
//! and `serve --ublk` refused in a build without the ublk feature or on a kernel without the
//! ublk driver; and the `bench paper` experiments that spawn the server themselves.
//!
//! A missing client binary fails the test with the apt package to install.

mod bench_paper;
mod checked;
mod cli;
mod common;
mod completion;
mod crash;
mod detach;
mod fio;
mod libnbd;
mod medium;
mod members;
mod panic;
mod qemu;
mod quickstart;
mod raw_socket;
mod rbd;
mod requests;
mod settings;
mod soak;
mod stores;
mod systemd;
mod tls;
mod ublk;
mod vhost;
mod volatile;
