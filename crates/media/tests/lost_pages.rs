//! The simulated medium's model of a poisoned line as the mapped medium meets it
//! (`CrashMedium::poison_mapped`): the first checked read that reaches the line loses the whole
//! page around it, as `PmemFile`'s handler replaces the page with a zeroed private one — the
//! page's other lines read as zeroes, checked reads of any of it fail, and stores to it are
//! seen by later loads but never reach the durable image or a power cut's.

use pmcache_media::{CrashMedium, CrashSwitch, Medium, Poisoned};

const PAGE: u64 = CrashMedium::PAGE_BYTES;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

/// Before any checked read reaches the poisoned line nothing is lost: the page's other lines
/// read back, and nothing is listed. The first checked read that reaches it loses the page:
/// every byte of it fails a checked read (with the first byte asked for), plain reads of it
/// see zeroes, and the medium lists the whole page; the pages around it are untouched.
#[test]
fn a_checked_read_of_a_poisoned_line_loses_its_whole_page() {
    let medium = CrashMedium::new(16 * PAGE, CrashSwitch::new(), 1);
    let data = pattern(3 * PAGE as usize, 7);
    medium.write_persist(4 * PAGE, &data);
    medium.poison_mapped(5 * PAGE + 640, 8);

    let mut line = [0u8; 64];
    medium.read_checked(5 * PAGE, &mut line).expect("another line of the page, before the loss");
    assert_eq!(line[..], data[PAGE as usize..PAGE as usize + 64]);
    assert!(medium.poisoned_ranges().is_empty(), "nothing lost before a read reaches the line");

    let mut block = vec![0u8; 1024];
    let err = medium.read_checked(5 * PAGE + 512, &mut block).expect_err("reaches the line");
    assert_eq!(err, Poisoned { offset: 5 * PAGE + 512 });
    assert_eq!(medium.poisoned_ranges(), vec![5 * PAGE..6 * PAGE]);
    assert_eq!(medium.read_checked(5 * PAGE, &mut line), Err(Poisoned { offset: 5 * PAGE }));
    let mut across = vec![0u8; 2 * PAGE as usize];
    assert_eq!(
        medium.read_checked(4 * PAGE + 100, &mut across[..PAGE as usize + 10]),
        Err(Poisoned { offset: 5 * PAGE })
    );
    medium.read(5 * PAGE, &mut across[..PAGE as usize]);
    assert!(across[..PAGE as usize].iter().all(|&b| b == 0), "a lost page reads as zeroes");
    medium.read_checked(4 * PAGE, &mut across[..PAGE as usize]).expect("the page before");
    assert_eq!(across[..PAGE as usize], data[..PAGE as usize]);
    medium.read_checked(6 * PAGE, &mut across[..PAGE as usize]).expect("the page after");
    assert_eq!(across[..PAGE as usize], data[2 * PAGE as usize..]);
}

/// Stores to a lost page are seen by later loads, and counted, but never become durable: the
/// durable image and every power cut's image keep what the page held when it was lost —
/// including what was flushed and fenced before.
#[test]
fn stores_to_a_lost_page_never_reach_the_medium() {
    let switch = CrashSwitch::new();
    let medium = CrashMedium::new(8 * PAGE, switch.clone(), 2);
    medium.store_u64(2 * PAGE + 8, 0x1111);
    medium.persist(2 * PAGE + 8, 8);
    medium.store_u64(3 * PAGE, 0x3333);
    medium.persist(3 * PAGE, 8);
    medium.lose_pages(2 * PAGE, 1);
    assert_eq!(medium.stores_to_lost_pages(), 0);
    assert_eq!(medium.load_u64(2 * PAGE + 8), 0, "lost: the private page is zeroed");

    medium.store_u64(2 * PAGE + 8, 0x2222);
    medium.write(2 * PAGE + 64, &[9u8; 100]);
    assert!(medium.compare_exchange_u64(2 * PAGE + 8, 0x2222, 0x4444));
    medium.persist(2 * PAGE, PAGE);
    medium.store_u64(3 * PAGE, 0x5555);
    medium.persist(3 * PAGE, 8);
    assert_eq!(medium.stores_to_lost_pages(), 3);
    assert_eq!(medium.load_u64(2 * PAGE + 8), 0x4444, "loads see the private page's stores");

    let word = |image: &[u64], offset: u64| image[(offset / 8) as usize];
    let durable = medium.durable_image();
    assert_eq!(word(&durable, 2 * PAGE + 8), 0x1111, "the file keeps what it held");
    assert_eq!(word(&durable, 2 * PAGE + 64), 0);
    assert_eq!(word(&durable, 3 * PAGE), 0x5555, "the next page is the file's");
    for _ in 0..50 {
        let image = medium.power_cut_image();
        assert_eq!(word(&image, 2 * PAGE + 8), 0x1111);
        assert_eq!(word(&image, 2 * PAGE + 64), 0);
    }
    switch.cut_now();
    let image = medium.crash_image().expect("cut");
    assert_eq!(word(&image, 2 * PAGE + 8), 0x1111);

    // A medium made from the image has the page back (poison is not part of an image).
    let again = CrashMedium::from_image(image, CrashSwitch::new(), 3);
    assert!(again.poisoned_ranges().is_empty());
    assert_eq!(again.load_u64(2 * PAGE + 8), 0x1111);
}

/// A plain access of a line poisoned as the mapped medium meets it is a machine check: the
/// simulation panics, for loads of words as for reads.
#[test]
#[should_panic(expected = "plain access of poisoned byte")]
fn a_plain_load_of_a_latent_poisoned_line_panics() {
    let medium = CrashMedium::new(4 * PAGE, CrashSwitch::new(), 1);
    medium.poison_mapped(PAGE + 64, 1);
    medium.load_u64(PAGE + 64);
}

/// A checked read that reaches poisoned lines on two pages loses both, and fails at the
/// first byte of the first.
#[test]
fn a_read_across_two_poisoned_pages_loses_both() {
    let medium = CrashMedium::new(8 * PAGE, CrashSwitch::new(), 1);
    medium.poison_mapped(2 * PAGE + 128, 1);
    medium.poison_mapped(3 * PAGE + 4032, 1);
    let mut buf = vec![0u8; 2 * PAGE as usize];
    assert_eq!(
        medium.read_checked(2 * PAGE + 64, &mut buf),
        Err(Poisoned { offset: 2 * PAGE + 64 })
    );
    assert_eq!(medium.poisoned_ranges(), vec![2 * PAGE..3 * PAGE, 3 * PAGE..4 * PAGE]);
    // Plain reads of the lost pages no longer fault.
    medium.read(2 * PAGE, &mut buf);
}

/// A page lost at the instant a store reaches it (`lose_page_at_store`): the loss is counted
/// (`Medium::losses`) before the store, which goes to the replacement and never reaches the
/// medium; the other pages keep their stores; the loss happens once.
#[test]
fn a_page_lost_at_a_store_is_counted_before_the_store() {
    let medium = CrashMedium::new(4 * 4096, CrashSwitch::new(), 1);
    assert_eq!(medium.losses(), 0);
    medium.lose_page_at_store(4096..3 * 4096);
    medium.write_persist(0, &pattern(64, 1));
    assert!(medium.loss_at_store_armed(), "a store outside the trigger loses nothing");
    medium.write_persist(2 * 4096 + 128, &pattern(64, 2));
    assert!(!medium.loss_at_store_armed());
    assert_eq!(medium.losses(), 1);
    assert_eq!(medium.poisoned_ranges(), vec![2 * 4096..3 * 4096]);
    assert_eq!(medium.stores_to_lost_pages(), 1);
    medium.write_persist(4096, &pattern(64, 3));
    assert_eq!(medium.losses(), 1, "once");
    let image = medium.durable_image();
    let bytes: Vec<u8> = image.iter().flat_map(|w| w.to_le_bytes()).collect();
    assert_eq!(bytes[..64], pattern(64, 1)[..]);
    assert_eq!(bytes[4096..4096 + 64], pattern(64, 3)[..]);
    assert_eq!(bytes[2 * 4096 + 128..2 * 4096 + 192], [0u8; 64][..], "the store never landed");
}
