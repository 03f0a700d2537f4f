//! The vhost-user backend of one connection: the device's features and configuration, the
//! guest's memory as the VMM maps it to this process, and one worker thread per virtqueue,
//! each serving its queue's kicks on its own [`QueueServer`] (its own engine lane).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock};

use pmcache_block::BlockConn;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::QueueOwnedT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier,
};

use crate::queue::{QueueCounters, QueueServer};
use crate::virtio::Geometry;

type Memory = GuestMemoryAtomic<GuestMemoryMmap>;

/// A connection's backend: [`VhostUserBackend`] for the rust-vmm daemon.
pub struct BlkBackend<T> {
    geometry: Geometry,
    config: Vec<u8>,
    /// One server per virtqueue, each locked only by its queue's worker thread (and by
    /// `counters`).
    queues: Vec<Mutex<QueueServer<T>>>,
    memory: RwLock<Option<Memory>>,
    event_idx: AtomicBool,
}

impl<T: BlockConn> BlkBackend<T> {
    /// A backend for a device of `geometry`, serving virtqueue `i` on `targets[i]`.
    pub fn new(geometry: Geometry, targets: Vec<T>) -> Self {
        assert_eq!(targets.len(), usize::from(geometry.queues), "one target per virtqueue");
        Self {
            config: geometry.config_space(),
            queues: targets
                .into_iter()
                .map(|t| Mutex::new(QueueServer::new(t, geometry)))
                .collect(),
            geometry,
            memory: RwLock::new(None),
            event_idx: AtomicBool::new(false),
        }
    }

    /// The counters of every queue, added up.
    pub fn counters(&self) -> QueueCounters {
        self.queues.iter().fold(QueueCounters::default(), |mut sum, q| {
            let c = q.lock().unwrap_or_else(|e| e.into_inner()).counters();
            sum.requests += c.requests;
            sum.batches += c.batches;
            sum.errors += c.errors;
            sum.bounced += c.bounced;
            sum
        })
    }

    /// Serves what the guest made available on queue `index` until it is empty, then answers.
    fn serve_queue(&self, index: usize, vring: &VringRwLock) -> io::Result<()> {
        let Some(memory) = self.memory.read().unwrap_or_else(|e| e.into_inner()).clone() else {
            return Err(io::Error::other("a kick before the guest's memory table"));
        };
        let mut queue = self.queues[index].lock().unwrap_or_else(|e| e.into_inner());
        let event_idx = self.event_idx.load(Ordering::Relaxed);
        let mut answered = Vec::with_capacity(usize::from(self.geometry.queue_size));
        loop {
            if event_idx {
                vring.disable_notification().map_err(io::Error::other)?;
            }
            loop {
                let mem = memory.memory();
                let chains: Vec<_> = vring
                    .get_mut()
                    .get_queue_mut()
                    .iter(mem.clone())
                    .map_err(io::Error::other)?
                    .collect();
                if chains.is_empty() {
                    break;
                }
                answered.clear();
                queue.serve(&mem, chains, &mut answered);
                for &(head, used_bytes) in &answered {
                    vring.add_used(head, used_bytes).map_err(io::Error::other)?;
                }
                if vring.needs_notification().map_err(io::Error::other)? {
                    vring.signal_used_queue()?;
                }
            }
            if !event_idx || !vring.enable_notification().map_err(io::Error::other)? {
                return Ok(());
            }
        }
    }
}

impl<T: BlockConn + Send + 'static> VhostUserBackend for BlkBackend<T> {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        usize::from(self.geometry.queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.geometry.queue_size)
    }

    fn features(&self) -> u64 {
        self.geometry.features()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let (offset, size) = (offset as usize, size as usize);
        let mut out = vec![0u8; size];
        if offset < self.config.len() {
            let take = size.min(self.config.len() - offset);
            out[..take].copy_from_slice(&self.config[offset..offset + take]);
        }
        out
    }

    fn update_memory(&self, memory: Memory) -> io::Result<()> {
        *self.memory.write().unwrap_or_else(|e| e.into_inner()) = Some(memory);
        Ok(())
    }

    /// A worker thread per virtqueue: each queue's lane is served by one thread.
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.geometry.queues).map(|q| 1u64 << q).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK | EventFlag::CLOEXEC).ok()
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock],
        _thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected events {evset:?}")));
        }
        let index = usize::from(device_event);
        if index >= self.queues.len() {
            return Err(io::Error::other(format!("an event for queue {index}")));
        }
        // Each thread has one queue: its own vring comes first.
        let vring = vrings.first().ok_or_else(|| io::Error::other("no vring for the thread"))?;
        self.serve_queue(index, vring)
    }
}
