//! A `DramTable` maps its size rounded to 4 KiB pages, starting on a huge-page boundary — the
//! reservation's head and tail are given back — and unmaps it when dropped: the DRAM figure
//! the engine reports (bytes per slot) is what the process really holds. Read from
//! `/proc/self/maps`, in a test binary of its own so that no other test maps memory meanwhile.

use std::sync::atomic::AtomicU64;

use pmcache_media::DramTable;

/// The mappings of this process, as (start, end) address pairs.
fn mappings() -> Vec<(usize, usize)> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    maps.lines()
        .map(|line| {
            let range = line.split_whitespace().next().expect("a range");
            let (start, end) = range.split_once('-').expect("start-end");
            let parse = |hex| usize::from_str_radix(hex, 16).expect("hex address");
            (parse(start), parse(end))
        })
        .collect()
}

#[test]
fn a_table_maps_its_pages_alone_and_gives_them_back() {
    for len in [1usize, 300_000, (2 << 20) / 8, 5 << 20] {
        let table = DramTable::<AtomicU64>::zeroed(len).expect("table");
        let start = table.as_ptr() as usize;
        let end = start + table.mapped_bytes();
        assert_eq!(table.mapped_bytes(), (len * 8).next_multiple_of(4096));
        assert_eq!(start % (2 << 20), 0, "not on a huge-page boundary");
        let maps = mappings();
        // The table's pages are mapped (the kernel may have split them into huge and small
        // page regions, or merged them with a neighbour)...
        let mapped = |at: usize| maps.iter().any(|&(s, e)| s <= at && at < e);
        assert!(mapped(start) && mapped(end - 1), "the table is not mapped");
        // ...and the reservation's head and tail are not: nothing of ours ends at its start
        // or begins at its end unless it is another mapping entirely (not anonymous reserve).
        let head_kept = maps.iter().any(|&(s, e)| e == start && start - s < 2 << 20);
        let tail_kept = maps.iter().any(|&(s, e)| s == end && e - end < 2 << 20);
        assert!(!head_kept, "the reservation's head is still mapped before {start:#x}");
        assert!(!tail_kept, "the reservation's tail is still mapped after {end:#x}");
        drop(table);
        let maps = mappings();
        assert!(
            !maps.iter().any(|&(s, e)| s <= start && start < e),
            "the table is still mapped after drop"
        );
    }
}
