//! Sizes as the command line gives them (`64M`, `1G`) and bytes as people read them.

/// Parses `512`, `64K`, `1G`, `8GiB`, `2T`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let trimmed = text.trim().trim_end_matches("iB").trim_end_matches('B');
    let (digits, shift) = match trimmed.chars().last() {
        Some('K' | 'k') => (&trimmed[..trimmed.len() - 1], 10),
        Some('M' | 'm') => (&trimmed[..trimmed.len() - 1], 20),
        Some('G' | 'g') => (&trimmed[..trimmed.len() - 1], 30),
        Some('T' | 't') => (&trimmed[..trimmed.len() - 1], 40),
        _ => (trimmed, 0),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .ok_or_else(|| format!("{text:?} is not a size (examples: 4096, 64M, 1G)"))
}

/// Parses a size as [`parse_size`] does, refusing 0: for a size something must have.
pub fn parse_nonzero_size(text: &str) -> Result<u64, String> {
    match parse_size(text)? {
        0 => Err(format!("{text:?} is no size here: it must be more than 0")),
        n => Ok(n),
    }
}

/// Human-readable bytes.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {}", UNITS[unit]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(parse_size("0"), Ok(0));
    }

    #[test]
    fn nonzero_sizes_refuse_zero() {
        assert_eq!(parse_nonzero_size("256M"), Ok(256 << 20));
        assert_eq!(parse_nonzero_size("2GiB"), Ok(2 << 30));
        assert!(parse_nonzero_size("0").is_err());
        assert!(parse_nonzero_size("0K").is_err());
        assert!(parse_nonzero_size("x").is_err());
    }

    #[test]
    fn bytes_read_in_binary_units() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1 << 30), "1.0 GiB");
        assert_eq!(human(3 << 19), "1.5 MiB");
    }
}
