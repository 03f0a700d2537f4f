//! Devices left by a server that died, and taking them over.
//!
//! A device added with `UBLK_F_USER_RECOVERY` outlives its server: when the server dies the
//! driver quiesces the device (requests wait in the block layer; those the server had taken
//! are re-issued where `UBLK_F_USER_RECOVERY_REISSUE` is on) and `/dev/ublkbN` stays, with
//! whatever file system is mounted on it. A new server takes it over with
//! `START_USER_RECOVERY`, sets its queues up again, and `END_USER_RECOVERY` makes it live.
//!
//! Which cache a device serves is recorded in the device itself: the device's `ublksrv_flags`
//! (kept by the driver for the server, never interpreted by it) hold the [`OwnerTag`] of the
//! cache. A take-over is refused unless the tag, the size and the block size match, so that a
//! file system is never handed to another cache.
//!
//! [`probe`] describes a device, [`list`] finds every device, [`remove`] deletes one no
//! server holds, and [`Device::recover`] takes one over.

use std::path::Path;
use std::sync::Arc;

use libublk::UblkFlags;
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::sys;

use crate::device::{
    Device, DeviceConfig, DeviceError, QueueWaits, check_driver, control_flags, ublk,
};
use crate::mapping::SECTOR_BYTES;

/// The identity of the cache a device serves, kept in the device by the driver: the first
/// eight bytes of the cache's UUID, little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnerTag(pub u64);

impl OwnerTag {
    /// The tag of the cache whose superblock has `uuid`.
    pub fn of_uuid(uuid: &[u8; 16]) -> Self {
        let mut first = [0u8; 8];
        first.copy_from_slice(&uuid[..8]);
        Self(u64::from_le_bytes(first))
    }
}

/// A device's state, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceState {
    /// Added but not started, or stopped: nothing to take over.
    Dead,
    /// Served (or its server died moments ago and the driver has not noticed yet).
    Live,
    /// Its server died; requests wait for a successor.
    Quiesced,
    /// Its server died and requests fail (`UBLK_F_USER_RECOVERY_FAIL_IO`) until a successor
    /// takes over.
    FailIo,
    /// A state this build does not know.
    Other(u16),
}

impl DeviceState {
    fn from_driver(state: u16) -> Self {
        match u32::from(state) {
            sys::UBLK_S_DEV_DEAD => Self::Dead,
            sys::UBLK_S_DEV_LIVE => Self::Live,
            sys::UBLK_S_DEV_QUIESCED => Self::Quiesced,
            sys::UBLK_S_DEV_FAIL_IO => Self::FailIo,
            _ => Self::Other(state),
        }
    }
}

impl std::fmt::Display for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dead => f.write_str("dead (stopped)"),
            Self::Live => f.write_str("live"),
            Self::Quiesced => f.write_str("quiesced (its server died)"),
            Self::FailIo => f.write_str("failing I/O (its server died)"),
            Self::Other(state) => write!(f, "in state {state}"),
        }
    }
}

/// A device as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device number N.
    pub id: u32,
    /// Its state.
    pub state: DeviceState,
    /// The process that serves it, or served it last.
    pub server_pid: i32,
    /// Whether that process is still running.
    pub server_alive: bool,
    /// Hardware queues.
    pub queues: u16,
    /// Tags per queue.
    pub depth: u16,
    /// Largest request buffer.
    pub max_io_bytes: u32,
    /// User recovery is on: the device outlives its server.
    pub user_recovery: bool,
    /// Requests a dead server had taken are re-issued to its successor.
    pub reissue: bool,
    /// The cache it serves (zero for a device pmcache did not add).
    pub owner: OwnerTag,
    /// Its size (zero when its parameters were never set).
    pub size_bytes: u64,
    /// Its logical block size (zero when its parameters were never set).
    pub logical_block_bytes: u32,
}

impl DeviceInfo {
    /// Whether a server that died left the device for a successor: quiesced or failing I/O.
    /// (A live device whose server seems gone is not: the process may be in another PID
    /// namespace; the driver moves a dead server's device on within seconds: [`settle`].)
    pub fn orphaned(&self) -> bool {
        matches!(self.state, DeviceState::Quiesced | DeviceState::FailIo)
    }

    /// Live, with no process of its server to be seen: a server that died moments ago, or
    /// one in another PID namespace.
    fn settling(&self) -> bool {
        self.state == DeviceState::Live && !self.server_alive
    }
}

/// How long [`settle`] waits for the driver to notice a dead server.
const SETTLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// Describes device `id` once the driver has noticed that its server died: while it is live
/// with no process of its server to be seen, waits (up to 15 s) for it to be quiesced or
/// stopped.
pub fn settle(id: u32) -> Result<DeviceInfo, DeviceError> {
    let started = std::time::Instant::now();
    loop {
        let info = probe(id)?;
        if !info.settling() || started.elapsed() > SETTLE_TIMEOUT {
            return Ok(info);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// `START_USER_RECOVERY` on `ctrl`'s device (libublk retries for 30 s while the driver still
/// holds the dead server's queues, and then returns `-EBUSY` as a success).
pub(crate) fn start_user_recovery(ctrl: &UblkCtrl) -> Result<(), DeviceError> {
    let id = ctrl.dev_info().dev_id;
    match ctrl.start_user_recover() {
        Ok(r) if r >= 0 => Ok(()),
        Ok(r) | Err(libublk::UblkError::UringIOError(r) | libublk::UblkError::OtherError(r))
            if -r == libc::EBUSY =>
        {
            Err(DeviceError::Config(format!(
                "device {id} is still held by its old server after 30 s (START_USER_RECOVERY: \
                 busy)"
            )))
        }
        Err(libublk::UblkError::UringIOError(r) | libublk::UblkError::OtherError(r))
            if -r == libc::EINVAL =>
        {
            Err(DeviceError::Config(format!(
                "the driver refuses to recover device {id} (START_USER_RECOVERY: invalid; a \
                 recovery started before may have left it without queues): remove it with \
                 `pmcache ublk remove {id}`"
            )))
        }
        Ok(r) => Err(DeviceError::Ublk {
            what: "starting the user recovery (START_USER_RECOVERY)",
            source: libublk::UblkError::OtherError(r),
        }),
        Err(e) => Err(DeviceError::Ublk {
            what: "starting the user recovery (START_USER_RECOVERY)",
            source: e,
        }),
    }
}

/// Whether process `pid` exists.
fn process_alive(pid: i32) -> bool {
    pid > 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// Describes device `id`.
pub fn probe(id: u32) -> Result<DeviceInfo, DeviceError> {
    check_driver()?;
    let signed = i32::try_from(id).map_err(|_| DeviceError::NoDevice(id))?;
    let ctrl = UblkCtrl::new_simple(signed).map_err(|e| match e {
        libublk::UblkError::UringIOError(errno) | libublk::UblkError::OtherError(errno)
            if -errno == libc::ENODEV =>
        {
            DeviceError::NoDevice(id)
        }
        e => DeviceError::Ublk { what: "reading the device's information", source: e },
    })?;
    let info = ctrl.dev_info();
    let mut params = sys::ublk_params {
        len: size_of::<sys::ublk_params>() as u32,
        types: sys::UBLK_PARAM_TYPE_BASIC,
        ..Default::default()
    };
    // A device whose server died before setting them has none: size zero.
    let (size_bytes, logical_block_bytes) = match ctrl.get_params(&mut params) {
        Ok(_) => (params.basic.dev_sectors * SECTOR_BYTES, 1u32 << params.basic.logical_bs_shift),
        Err(_) => (0, 0),
    };
    Ok(DeviceInfo {
        id,
        state: DeviceState::from_driver(info.state),
        server_pid: info.ublksrv_pid,
        server_alive: process_alive(info.ublksrv_pid),
        queues: info.nr_hw_queues,
        depth: info.queue_depth,
        max_io_bytes: info.max_io_buf_bytes,
        user_recovery: info.flags & u64::from(sys::UBLK_F_USER_RECOVERY) != 0,
        reissue: info.flags & u64::from(sys::UBLK_F_USER_RECOVERY_REISSUE) != 0,
        owner: OwnerTag(info.ublksrv_flags),
        size_bytes,
        logical_block_bytes,
    })
}

/// Every ublk device there is (by its `/dev/ublkcN`), described; devices that vanish while
/// being read are left out.
pub fn list() -> Result<Vec<DeviceInfo>, DeviceError> {
    check_driver()?;
    let mut ids: Vec<u32> = std::fs::read_dir("/dev")
        .map_err(DeviceError::ControlAccess)?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.strip_prefix("ublkc")?.parse().ok())
        .collect();
    ids.sort_unstable();
    Ok(ids.into_iter().filter_map(|id| probe(id).ok()).collect())
}

/// Why a device cannot be taken over by a cache: what differs, to be shown as it is.
pub fn takeover_refusal(
    info: &DeviceInfo,
    owner: OwnerTag,
    size_bytes: u64,
    logical_block_bytes: u32,
) -> Option<String> {
    let id = info.id;
    if !info.user_recovery {
        return Some(format!(
            "device {id} was added without user recovery, so it cannot be taken over (remove \
             it with `pmcache ublk remove {id}`)"
        ));
    }
    if info.owner != owner {
        return Some(format!(
            "device {id} serves another cache (owner tag {:#018x}, this cache's is {:#018x}): \
             taking it over would hand its file system to the wrong data",
            info.owner.0, owner.0
        ));
    }
    if info.size_bytes != size_bytes || info.logical_block_bytes != logical_block_bytes {
        return Some(format!(
            "device {id} is {} B in {} B blocks, this cache serves {size_bytes} B in \
             {logical_block_bytes} B blocks",
            info.size_bytes, info.logical_block_bytes
        ));
    }
    match info.state {
        _ if info.orphaned() => None,
        DeviceState::Live => Some(format!(
            "device {id} is live, served by process {} (stop that server first; a server that \
             died moves its device to quiesced within seconds)",
            info.server_pid
        )),
        state => Some(format!("device {id} is {state}: there is nothing to take over")),
    }
}

/// Deletes device `id`, which no running server may hold: requests waiting on it fail, and
/// a file system mounted on it sees I/O errors. A device a live server holds is refused.
/// Returns at once where the driver has `DEL_DEV_ASYNC` (Linux 6.9): the device number is
/// freed once nothing holds the device (a file system mounted on it is unmounted); older
/// drivers are sent `DEL_DEV`, which waits for that.
pub fn remove(id: u32) -> Result<(), DeviceError> {
    let info = settle(id)?;
    if info.state == DeviceState::Live {
        return Err(DeviceError::Config(format!(
            "device {id} is live, served by process {}: stop that server (SIGTERM, or `pmcache \
             detach`) and it removes the device itself",
            info.server_pid
        )));
    }
    let open = || UblkCtrl::new_simple(info.id as i32).map_err(ublk("opening the device"));
    if open()?.del_dev_async().is_ok() {
        return Ok(());
    }
    open()?.del_dev().map(drop).map_err(ublk("deleting the device"))
}

impl Device {
    /// Takes over device `id`, left by a server that died, for `config`'s cache ([`Device::run`]
    /// sends `START_USER_RECOVERY`, sets the queues up and ends the recovery).
    /// The device keeps its number, queues and depth (`config` must have them: see
    /// [`probe`]); refused, with the reason, unless [`takeover_refusal`] finds nothing.
    pub fn recover(id: u32, config: DeviceConfig) -> Result<Self, DeviceError> {
        config.validate()?;
        let info = settle(id)?;
        if let Some(why) =
            takeover_refusal(&info, config.owner, config.size_bytes, config.logical_block_bytes)
        {
            return Err(DeviceError::Config(why));
        }
        let shape = (info.queues, info.depth, info.max_io_bytes);
        if shape != (config.queues, config.depth, config.max_io_bytes) {
            return Err(DeviceError::Config(format!(
                "device {id} has {} queues of depth {} and {} B requests; asked for {} of depth \
                 {} and {} B",
                info.queues,
                info.depth,
                info.max_io_bytes,
                config.queues,
                config.depth,
                config.max_io_bytes
            )));
        }
        let signed = id as i32;
        // START_USER_RECOVERY is sent by `run`, once everything that can fail is done.
        let ctrl = UblkCtrlBuilder::default()
            .name("pmcache")
            .id(signed)
            .nr_queues(config.queues)
            .depth(config.depth)
            .io_buf_bytes(config.max_io_bytes)
            .ctrl_flags(control_flags(true, None))
            .ctrl_target_flags(config.owner.0)
            .dev_flags(UblkFlags::UBLK_DEV_F_RECOVER_DEV)
            .build()
            .map_err(ublk("opening the device to take it over"))?;
        Ok(Self {
            ctrl: Arc::new(ctrl),
            stop_requested: Arc::default(),
            config,
            recovered: true,
            waits: Arc::new(QueueWaits::new(config.queues)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWNER: OwnerTag = OwnerTag(0x1122_3344_5566_7788);

    fn orphan() -> DeviceInfo {
        DeviceInfo {
            id: 3,
            state: DeviceState::Quiesced,
            server_pid: 4242,
            server_alive: false,
            queues: 2,
            depth: 64,
            max_io_bytes: 1 << 20,
            user_recovery: true,
            reissue: true,
            owner: OWNER,
            size_bytes: 8 << 30,
            logical_block_bytes: 4096,
        }
    }

    fn refusal(info: &DeviceInfo) -> Option<String> {
        takeover_refusal(info, OWNER, 8 << 30, 4096)
    }

    /// A device quiesced or failing I/O, of the same cache and shape, is taken over.
    #[test]
    fn an_orphan_of_the_same_cache_is_taken_over() {
        assert_eq!(refusal(&orphan()), None);
        assert_eq!(refusal(&DeviceInfo { state: DeviceState::FailIo, ..orphan() }), None);
    }

    /// Everything else is refused, saying why.
    #[test]
    fn anything_else_is_refused_with_the_reason() {
        let cases = [
            (DeviceInfo { user_recovery: false, ..orphan() }, "without user recovery"),
            (DeviceInfo { owner: OwnerTag(7), ..orphan() }, "serves another cache"),
            (DeviceInfo { size_bytes: 1 << 30, ..orphan() }, "this cache serves"),
            (DeviceInfo { logical_block_bytes: 512, ..orphan() }, "this cache serves"),
            (
                DeviceInfo { state: DeviceState::Live, server_alive: true, ..orphan() },
                "served by process 4242",
            ),
            // A live device whose server cannot be seen (another PID namespace, or a death
            // the driver has not noticed yet) is never taken over.
            (DeviceInfo { state: DeviceState::Live, ..orphan() }, "served by process 4242"),
            (DeviceInfo { state: DeviceState::Dead, ..orphan() }, "nothing to take over"),
        ];
        for (info, why) in cases {
            let text = refusal(&info).unwrap_or_default();
            assert!(text.contains(why), "{info:?}: {text:?}");
            assert!(text.contains("device 3"), "{text}");
        }
    }

    /// The tag is the UUID's first eight bytes.
    #[test]
    fn the_owner_tag_is_the_uuids_first_eight_bytes() {
        let uuid = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];
        assert_eq!(OwnerTag::of_uuid(&uuid), OwnerTag(0x0807_0605_0403_0201));
    }

    /// Orphaned: the driver says the server died and the device is still there.
    #[test]
    fn orphaned_means_the_driver_saw_the_server_die() {
        assert!(orphan().orphaned());
        assert!(DeviceInfo { state: DeviceState::FailIo, ..orphan() }.orphaned());
        for state in [DeviceState::Live, DeviceState::Dead, DeviceState::Other(9)] {
            assert!(!DeviceInfo { state, ..orphan() }.orphaned(), "{state}");
        }
        assert!(DeviceInfo { state: DeviceState::Live, ..orphan() }.settling());
        assert!(
            !DeviceInfo { state: DeviceState::Live, server_alive: true, ..orphan() }.settling()
        );
    }
}
