//! The engine's life: format, assembly, lanes, statistics, audit and clean shutdown.

use super::*;

impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    /// Whether [`Engine::format`] would accept a medium of `medium_bytes` for a backing store
    /// of `backing_bytes` with `config`: the same checks, before any medium exists (so a
    /// frontend can refuse before it creates one).
    pub fn check_format(medium_bytes: u64, backing_bytes: u64, config: &Config) -> Result<()> {
        Self::check_format_set(&[medium_bytes], backing_bytes, config)
    }

    /// [`Engine::check_format`] for a cache of several members of these lengths.
    pub fn check_format_set(
        member_bytes: &[u64],
        backing_bytes: u64,
        config: &Config,
    ) -> Result<()> {
        let mut at = 0;
        let spans: Vec<MemberSpan> = member_bytes
            .iter()
            .map(|&len| {
                at += len;
                MemberSpan { range: at - len..at, node: None }
            })
            .collect();
        let layout = Layout::for_format(&spans, config.block_size, config.data_crc)?;
        check_fit(layout.block_size, layout.slot_count, backing_bytes, config).map(|_| ())
    }

    /// Formats `medium` as an empty cache of `backing` and returns the engine: each of its
    /// members ([`Medium::members`]) a whole layout of its own, recording its place in the set
    /// and its node.
    pub fn format(medium: M, backing: B, clock: C, config: &Config) -> Result<Self> {
        let spans = medium.members();
        let layout = Layout::for_format(&spans, config.block_size, config.data_crc)?;
        // Every refusal comes before the first write: a format that cannot serve leaves the
        // medium as it was (an old cache on it included).
        check_fit(layout.block_size, layout.slot_count, backing.size_bytes(), config)?;
        crate::failpoint::arm_from_env().map_err(Error::Config)?;
        let identity = backing.identity();
        let mut uuid = [0u8; 16];
        rand::thread_rng().fill_bytes(&mut uuid);
        let created_unix_secs =
            SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let superblock_of = |member: &Member| Superblock {
            uuid,
            geometry: member.geometry,
            membership: Membership {
                index: member.index as u16,
                count: layout.members().len() as u16,
                node: member.node,
            },
            backing: identity,
            created_unix_secs,
        };
        // Invalidate every old superblock first, so a crash mid-format leaves no valid cache
        // (nor a member of one).
        for member in layout.members() {
            medium.write(member.base, &[0u8; format::HEADER_BYTES]);
            medium.persist(member.base, format::HEADER_BYTES as u64);
        }
        // Member 0's superblock last: until it is written, no member makes a cache.
        for member in layout.members().iter().rev() {
            let base = member.base;
            let meta_end = member.geometry.data_offset;
            zero_range(&medium, base + SUPERBLOCK_BYTES, meta_end - SUPERBLOCK_BYTES);
            medium.store_u64(base + SHUTDOWN_WORD_OFFSET, SHUTDOWN_DIRTY);
            medium.store_u64(base + SYNCED_SEQ_OFFSET, format::encode_synced_seq(0));
            medium.persist(base + SHUTDOWN_WORD_OFFSET, 16);
            medium.write(base, &superblock_of(member).encode());
            medium.persist(base, format::HEADER_BYTES as u64);
        }
        let superblock = superblock_of(&layout.members()[0]);
        let slot_count = layout.slot_count as u32;
        let engine = Self::assemble(medium, backing, clock, config, superblock, layout, 0)?;
        engine.retire_poisoned_slots();
        engine.pools.put(0..slot_count);
        Ok(engine)
    }

    /// Builds an engine with empty DRAM structures around a validated superblock (member
    /// 0's) and layout.
    pub(crate) fn assemble(
        medium: M,
        backing: B,
        clock: C,
        config: &Config,
        superblock: Superblock,
        layout: Layout,
        synced_seq: u64,
    ) -> Result<Self> {
        crate::failpoint::arm_from_env().map_err(Error::Config)?;
        let eviction = config.eviction.policy();
        let backing_blocks =
            check_fit(layout.block_size, layout.slot_count, backing.size_bytes(), config)?;
        let slot_count = layout.slot_count as u32;
        let lane_free_max = (slot_count as usize / (4 * config.max_lanes)).clamp(1, 256);
        let stripe_count = (config.max_lanes * 64).next_power_of_two().max(1024);
        let members = layout.members().len();
        Ok(Self {
            slots: SlotTable::new(slot_count)?,
            index: Index::with_buckets(slot_count, config.index_buckets)?,
            stripes: (0..stripe_count)
                .map(|_| {
                    CachePadded::new(Stripe {
                        lock: Mutex::new(0),
                        pending_free: AtomicU64::new(0),
                        pending_free_fences: AtomicU64::new(0),
                        cleaning: AtomicU32::new(0),
                        writing: AtomicU32::new(0),
                        changes: AtomicU64::new(0),
                    })
                })
                .collect(),
            pools: Pools::new(layout.members().iter().map(|m| (m.first_slot, m.slot_count))),
            hands: (0..members).map(|_| CachePadded::new(AtomicU64::new(0))).collect(),
            placement: Placement::new(&layout, &config.placement),
            next_seq: AtomicU64::new(first_seq_after(synced_seq)),
            synced_seq: Mutex::new(synced_seq),
            // One write counted before any: whatever wrote the backing store before this
            // attach (an earlier process of this cache that stopped without a clean shutdown,
            // or anything else) may have left data in its volatile cache, which the first
            // flush must sync like this engine's own writes.
            backing_writes: AtomicU64::new(1),
            backing_writes_synced: AtomicU64::new(0),
            backing_errors: AtomicU64::new(0),
            backing_health: crate::health::HealthTracker::new(),
            backing_sync_failed: AtomicBool::new(false),
            lanes: (0..config.max_lanes)
                .map(|_| LaneSlot {
                    in_use: AtomicBool::new(false),
                    counters: CachePadded::new(LaneCounters::default()),
                    fences: CachePadded::new(AtomicU64::new(0)),
                    mode_pin: CachePadded::new(AtomicU64::new(0)),
                    members: (0..members).map(|_| MemberCounters::default()).collect(),
                })
                .collect(),
            closed: AtomicBool::new(false),
            lifecycle: Mutex::new(()),
            mode: AtomicU64::new(super::mode::mode_word(config.mode, 1)),
            mode_switch: Mutex::new(()),
            fence_asymmetric: !cfg!(feature = "shuttle")
                && pmcache_media::barrier::register_heavy_fence(),
            admission: Admission::new(config.admission),
            cleaner: CleanerShared::new(),
            eviction,
            marks_hits: eviction.marks_hits(),
            zero_block_crc: crc32c::crc32c(&vec![0u8; layout.block_size as usize]),
            recovered_dirty: 0,
            lane_free_max,
            refill_batch: (lane_free_max / 2).clamp(1, 64),
            freed_spill: lane_free_max.min(FREED_SPILL_MAX),
            group_max: (slot_count as usize / (2 * config.max_lanes)).clamp(1, batch::GROUP_MAX),
            zero_through_blocks_min: AtomicU64::new(zeroes::ZERO_THROUGH_BLOCKS_MIN),
            medium,
            backing,
            clock,
            superblock,
            layout,
            backing_blocks,
        })
    }

    /// A handle for one thread or queue. At most `Config::max_lanes` exist at once.
    pub fn lane(&self) -> Result<Lane<'_, M, B, C>> {
        let lifecycle = lock(&self.lifecycle);
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::ShutDown);
        }
        let id = self
            .lanes
            .iter()
            .position(|l| {
                l.in_use.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            })
            .ok_or(Error::TooManyLanes { max_lanes: self.lanes.len() })?;
        drop(lifecycle);
        let lane_list_max = (self.lane_free_max * 2).max(self.freed_spill + 2 * batch::GROUP_MAX);
        Ok(Lane {
            engine: self,
            id,
            shared: &self.lanes[id],
            // Both hold the other's slots at times (`alloc` moves `freed` into `free`).
            free: Vec::with_capacity(lane_list_max),
            freed: Vec::with_capacity(lane_list_max),
            freed_durable: 0,
            seq_next: 0,
            seq_end: 0,
            block: vec![0u8; self.layout.block_size as usize],
            write_back_block: vec![0u8; self.layout.block_size as usize],
            checked_block: if self.layout.data_crc() {
                vec![0u8; self.layout.block_size as usize]
            } else {
                Vec::new()
            },
            scratch_slots: Vec::with_capacity(DRAIN_BATCH),
            scratch_refused: Vec::with_capacity(2 * WRITE_BACK_FAILURES_MAX),
            written: Vec::with_capacity(DRAIN_BATCH),
            frees_unzeroed: Vec::with_capacity(2 * batch::GROUP_MAX),
            group: Vec::with_capacity(self.group_max),
            group_next: Vec::with_capacity(self.group_max),
            group_alone: Vec::with_capacity(self.group_max),
            frees_unfenced: false,
            fences_seen: vec![0; self.lanes.len()].into_boxed_slice(),
            miss_queue: super::misses::MissQueue::Unopened,
            misses: super::misses::MissesInFlight::new(),
            read_starts: Vec::new(),
            write_starts: Vec::new(),
            write_outcomes: Vec::new(),
            mode_pinned: None,
            mode_pins: 0,
            node: None,
            refills: 0,
            // The first read asks which node the lane runs on.
            reads_since_node_check: NODE_CHECK_READS,
        })
    }

    /// The read-miss admission policy in force.
    pub fn admission(&self) -> crate::AdmissionConfig {
        self.admission.config()
    }

    /// Puts a read-miss admission policy in force, at once, for every lane.
    pub fn set_admission(&self, config: crate::AdmissionConfig) {
        self.admission.set(config);
    }

    /// Sets how many whole blocks a write-zeroes in a write-back mode must cover for its
    /// uncached blocks to be zeroed on the backing store instead of written into the cache as
    /// zero blocks (default 256; at least 1). Tests lower it to reach that path with a small
    /// device.
    pub fn set_zero_through_blocks_min(&self, blocks: u64) {
        self.zero_through_blocks_min.store(blocks.max(1), Ordering::Relaxed);
    }

    /// Size of the exported device in bytes (the backing store's size).
    pub fn size_bytes(&self) -> u64 {
        self.backing_blocks * u64::from(self.layout.block_size)
    }

    /// Cache block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.layout.block_size
    }

    /// The superblock in use.
    pub fn superblock(&self) -> &Superblock {
        &self.superblock
    }

    /// The cache's members and where its slots are.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Each member's figures: its node, slots, dirty and free slots, and the reads and writes
    /// lanes made of it, local or remote. The dirty count reads every slot's state (a pass
    /// over the slot table: for a status command, not a hot loop). A one-member cache does not
    /// count its reads per member (nothing to place): its local reads are `Stats::read_hits`,
    /// and every write is local.
    pub fn member_stats(&self) -> Vec<MemberStats> {
        let mut out: Vec<MemberStats> = self
            .layout
            .members()
            .iter()
            .map(|member| MemberStats {
                index: member.index,
                node: member.node,
                slots: u64::from(member.slot_count),
                free: self.pools.len_of(member.index),
                ..Default::default()
            })
            .collect();
        for lane in self.lanes.iter() {
            for (counters, stats) in lane.members.iter().zip(out.iter_mut()) {
                counters.add_to(stats);
            }
        }
        for slot in 0..self.slots.len() {
            if self.slots.load(slot).state() == SlotState::Dirty {
                out[self.layout.member_of(slot)].dirty += 1;
            }
        }
        if self.placement.single() {
            out[0].reads_local = self.stats().read_hits;
        }
        out
    }

    /// The medium (for tests and tools).
    pub fn medium(&self) -> &M {
        &self.medium
    }

    /// The backing store.
    pub fn backing(&self) -> &B {
        &self.backing
    }

    /// Summed statistics.
    pub fn stats(&self) -> Stats {
        let mut stats = Stats::default();
        for lane in self.lanes.iter() {
            lane.counters.add_to(&mut stats);
        }
        // The lanes' counters are read one after another, not at one instant: a block made
        // dirty by one lane and cleaned by another between the two reads counts only as
        // cleaned, so the sum can dip below zero (as a signed number) for a moment.
        let dirty = self.recovered_dirty.wrapping_add(stats.dirty_delta) as i64;
        stats.dirty_slots = dirty.max(0) as u64;
        stats.slot_count = self.layout.slot_count;
        stats.block_size = self.layout.block_size;
        stats.dram_bytes_per_slot = self.dram_bytes() as f64 / self.layout.slot_count as f64;
        stats.backing_errors = self.backing_errors.load(Ordering::Relaxed);
        stats.retired_slots = self.pools.retired();
        stats.backing = self.backing_health.health();
        stats.cleaner = self.cleaner.stats();
        stats
    }

    /// Checks that the engine's DRAM structures agree with the medium and with each other,
    /// for tests and diagnostics; every lane must be dropped (nothing in flight). Each slot
    /// that holds a block has a valid metadata entry in the same state, and the block's index
    /// entry points at it, visible; the index holds no other entry; each free slot is in the
    /// shared pool (unless retired: on a poisoned line) and the pool holds nothing else.
    /// Returns the number of cached blocks, or what disagrees.
    pub fn audit(&self) -> std::result::Result<u64, String> {
        let open = self.lanes.iter().filter(|l| l.in_use.load(Ordering::Acquire)).count();
        if open > 0 {
            return Err(format!("{open} lanes are open"));
        }
        let (mut cached, mut free) = (0, 0);
        for slot in 0..self.slots.len() {
            let state = self.slots.load(slot).state();
            let expected = match state {
                SlotState::Free => {
                    if self.pools.is_retired(slot) {
                        if self.pools.holds(slot) {
                            return Err(format!("retired slot {slot} is in the pool"));
                        }
                        continue;
                    }
                    free += 1;
                    if !self.pools.holds(slot) {
                        return Err(format!("free slot {slot} is not in the pool"));
                    }
                    continue;
                }
                SlotState::Clean => BlockState::Clean,
                SlotState::Dirty => BlockState::Dirty,
            };
            let entry = match self.read_entry(slot) {
                DecodedEntry::Valid(entry) if entry.state == expected => entry,
                other => return Err(format!("{state:?} slot {slot} has the entry {other:?}")),
            };
            match self.index.lookup(entry.lba) {
                Some(found) if found.slot == slot && !found.hidden => cached += 1,
                other => {
                    return Err(format!(
                        "slot {slot} holds block {}, indexed as {other:?}",
                        entry.lba
                    ));
                }
            }
        }
        let indexed = self.index.occupied() as u64;
        if indexed != cached {
            return Err(format!("the index holds {indexed} entries for {cached} cached blocks"));
        }
        let pooled = self.pools.len();
        if pooled != free {
            return Err(format!("the pool holds {pooled} slots for {free} free ones"));
        }
        Ok(cached)
    }

    /// DRAM the engine's structures use, in bytes.
    pub fn dram_bytes(&self) -> usize {
        self.slots.len() as usize * 4
            + self.index.bytes()
            + self.pools.bytes()
            + self.stripes.len() * std::mem::size_of::<CachePadded<Stripe>>()
            + self.lanes.len() * std::mem::size_of::<LaneSlot>()
    }

    /// Marks the cache cleanly shut down (after syncing the backing store). Every lane must
    /// have been dropped; afterwards the engine hands out no lanes (a second call does
    /// nothing). Refused with lanes open, or failed by the backing store's sync, it changes
    /// nothing: the cache keeps serving, and is not marked clean.
    pub fn shutdown(&self) -> Result<()> {
        let _lifecycle = lock(&self.lifecycle);
        if self.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        let open = self.lanes.iter().filter(|l| l.in_use.load(Ordering::Acquire)).count();
        if open > 0 {
            return Err(Error::LanesOpen { open });
        }
        self.sync_backing()?;
        let last = self.last_issued_seq();
        let mut synced = lock(&self.synced_seq);
        self.medium.store_u64(SYNCED_SEQ_OFFSET, format::encode_synced_seq(last.max(*synced)));
        *synced = last.max(*synced);
        self.medium.store_u64(SHUTDOWN_WORD_OFFSET, SHUTDOWN_CLEAN);
        self.medium.persist(SHUTDOWN_WORD_OFFSET, 16);
        self.closed.store(true, Ordering::Release);
        Ok(())
    }
}
