//! The server's control plane against rust-vmm's own vhost-user frontend (what a VMM says
//! first): features and configuration space as offered, a VMM that goes away followed by
//! another on the same socket, and the stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pmcache_block::{BlockConn, BlockError};
use pmcache_vhost::virtio::ID_BYTES;
use pmcache_vhost::{Geometry, Stopper};
use vhost::VhostBackend;
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};

/// A target that is never asked for I/O here.
struct Idle;

impl BlockConn for Idle {
    fn read(&mut self, _: u64, _: &mut [u8]) -> Result<(), BlockError> {
        unreachable!("no I/O in the control-plane test")
    }
    fn write(&mut self, _: u64, _: &[u8], _: bool) -> Result<(), BlockError> {
        unreachable!("no I/O in the control-plane test")
    }
    fn flush(&mut self) -> Result<(), BlockError> {
        Ok(())
    }
    fn trim(&mut self, _: u64, _: u64, _: bool) -> Result<(), BlockError> {
        Ok(())
    }
    fn write_zeroes(&mut self, _: u64, _: u64, _: bool, _: bool) -> Result<(), BlockError> {
        Ok(())
    }
}

fn geometry() -> Geometry {
    Geometry {
        size_bytes: 64 << 20,
        block_bytes: 4096,
        physical_block_exp: 0,
        queues: 3,
        queue_size: 128,
        read_only: false,
        serial: [b'x'; ID_BYTES],
    }
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Negotiates as a VMM does and reads the configuration space.
fn negotiate(socket: &std::path::Path) -> (u64, Vec<u8>) {
    let mut vmm = Frontend::connect(socket, 3).expect("connect");
    vmm.set_owner().expect("set_owner");
    let features = vmm.get_features().expect("get_features");
    vmm.set_features(features).expect("set_features");
    let protocol = vmm.get_protocol_features().expect("get_protocol_features");
    assert!(protocol.contains(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ));
    vmm.set_protocol_features(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ)
        .expect("set_protocol_features");
    assert_eq!(vmm.get_queue_num().expect("get_queue_num"), 3);
    let (_, config) =
        vmm.get_config(0, 60, VhostUserConfigFlags::WRITABLE, &[0u8; 60]).expect("get_config");
    (features, config.to_vec())
}

#[test]
fn a_vmm_negotiates_goes_away_and_another_connects_until_the_stop() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("vub.sock");
    let stopper = Stopper::default();
    let made = Arc::new(AtomicUsize::new(0));
    let server = {
        let (socket, stopper, made) = (socket.clone(), stopper.clone(), made.clone());
        std::thread::spawn(move || {
            let targets = || {
                made.fetch_add(1, Ordering::SeqCst);
                Ok((0..3).map(|_| Idle).collect())
            };
            pmcache_vhost::serve(&socket, geometry(), targets, &stopper, || {})
        })
    };
    wait_for("the socket", || socket.exists());
    let (features, config) = negotiate(&socket);
    assert_ne!(features & (1 << 32), 0, "VIRTIO_F_VERSION_1");
    assert_ne!(features & (1 << 12), 0, "VIRTIO_BLK_F_MQ");
    assert_eq!(config, geometry().config_space()[..60].to_vec());
    assert_eq!(u64::from_le_bytes(config[..8].try_into().unwrap()), (64 << 20) / 512);
    // The first VMM is gone (its frontend dropped); the server takes the next one, with
    // targets of its own.
    assert_eq!(stopper.connections(), 1);
    let (_, again) = negotiate(&socket);
    assert_eq!(again, config);
    assert_eq!(made.load(Ordering::SeqCst), 2, "a set of targets per connection");
    assert_eq!(stopper.connections(), 2);
    // A stop while a VMM is connected ends the connection and the server.
    let _vmm = Frontend::connect(&socket, 3).expect("connect");
    wait_for("the third connection", || stopper.connections() == 3);
    stopper.stop();
    server.join().unwrap().expect("the server ends cleanly");
    assert!(!socket.exists(), "the socket is removed at the end");
}

#[test]
fn a_socket_that_exists_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("taken");
    std::fs::write(&socket, b"").unwrap();
    let err =
        pmcache_vhost::serve(&socket, geometry(), || Ok(vec![Idle]), &Stopper::default(), || {})
            .unwrap_err();
    assert!(err.to_string().contains("taken"), "{err}");
    assert!(socket.exists(), "what was there is left alone");
}
