//! Malformed traffic from raw sockets against `pmcache serve`: requests out of range,
//! misaligned, oversize, with an unknown command or flag get the NBD errors and the
//! connection keeps working; garbage handshakes and a bad request magic close only their
//! connection; the server still serves well-behaved clients (raw and qemu-io) afterwards.

use std::process::Command;
use std::time::Duration;

use pmcache_nbd::codec::*;

use crate::common::*;

type Malformed<'a> = (u16, u16, u64, u64, &'a [u8], u32);

#[test]
fn malformed_requests_get_errors_and_the_server_keeps_serving() {
    let size = 64 * MIB;
    let setup = Setup::new("raw", size, 4 * MIB);
    let server = setup.serve(Via::Tcp, &[]);
    let addr = server.addr();
    let mut c = NbdClient::ready(addr);
    assert_eq!(c.size_bytes, size);
    let want_flags = FLAG_HAS_FLAGS
        | FLAG_SEND_FLUSH
        | FLAG_SEND_FUA
        | FLAG_SEND_TRIM
        | FLAG_SEND_WRITE_ZEROES
        | FLAG_CAN_MULTI_CONN;
    assert_eq!(c.flags & want_flags, want_flags, "{:#x}", c.flags);
    let max = 32 * MIB;
    let oversize = vec![0xcc; (max + 512) as usize];
    // All pipelined in one burst; replies come back in order.
    // (command, flags, offset, length, payload, expected NBD error)
    let sent: [Malformed; 15] = [
        (CMD_READ, 0, size, 512, &[], NBD_EINVAL), // past the end
        (CMD_WRITE, 0, size - 512, 1024, &[1; 1024], NBD_ENOSPC), // past the end
        (CMD_READ, 0, u64::MAX - 511, 512, &[], NBD_EINVAL), // offset + length overflows
        (CMD_READ, 0, 1, 512, &[], NBD_EINVAL),    // misaligned offset
        (CMD_WRITE, 0, 0, 100, &[2; 100], NBD_EINVAL), // misaligned length
        (CMD_READ, 0, 0, max + 512, &[], NBD_EOVERFLOW), // oversize read
        (CMD_WRITE, 0, 0, max + 512, &oversize, NBD_EOVERFLOW), // oversize write
        (42, 0, 0, 512, &[], NBD_EINVAL),          // unknown command
        (CMD_CACHE, 0, 0, 512, &[], NBD_EINVAL),   // not supported
        (CMD_READ, 1 << 9, 0, 512, &[], NBD_EINVAL), // unknown flag
        (CMD_FLUSH, 0, 512, 0, &[], NBD_EINVAL),   // flush with an offset
        (CMD_BLOCK_STATUS, 0, 0, 512, &[], NBD_EINVAL), // not negotiated
        (CMD_TRIM, 0, size - 512, 1024, &[], NBD_EINVAL), // trim past the end
        (CMD_WRITE_ZEROES, 0, size, 512, &[], NBD_ENOSPC), // zeroes past the end
        (CMD_WRITE_ZEROES, 0, 512, 1000, &[], NBD_EINVAL), // misaligned zeroes
    ];
    for (i, (cmd, flags, offset, len, payload, _)) in sent.iter().enumerate() {
        c.request(*cmd, *flags, i as u64 + 1, *offset, *len as u32, payload);
    }
    for (i, (.., want)) in sent.iter().enumerate() {
        assert_eq!(c.simple_reply(), (*want, i as u64 + 1), "request {}", i + 1);
    }
    // Nothing was written by the refused writes, and the connection works at full size.
    assert_eq!(c.read_at(0, 4096), vec![0u8; 4096]);
    assert_eq!(c.read_at(size - 4096, 4096), vec![0u8; 4096]);
    let big = pseudo_random(max as usize, 3);
    c.write_at(size - max, &big, CMD_FLAG_FUA);
    assert!(c.read_at(size - max, max as u32) == big);
    c.request(CMD_DISC, 0, 99, 0, 0, &[]);
    assert!(c.is_closed());

    // Garbage handshakes and a bad request magic close only their own connection.
    let mut good = NbdClient::ready(addr);
    for (what, mut c) in pmcache_testkit::nbd::misbehaving_clients(addr) {
        assert!(c.is_closed(), "{what}: connection not closed");
    }
    let data = pseudo_random(8192, 11);
    good.write_at(4096 + 512, &data, 0);
    assert!(good.read_at(4096 + 512, 8192) == data);
    let mut fresh = NbdClient::ready(addr);
    assert!(fresh.read_at(4096 + 512, 8192) == data);

    // A real client afterwards.
    require_tool("qemu-io", "qemu-utils");
    run_ok(
        Command::new("qemu-io").args([
            "-f",
            "raw",
            &server.uri,
            "-c",
            "write -P 5 0 65536",
            "-c",
            "read -P 5 0 65536",
        ]),
        Duration::from_secs(30),
    );
    let logs = server.terminate();
    assert!(logs.contains("cache marked clean"), "{logs}");
}
