//! What the experiments show while they run, and how their figures are printed.

use std::io::Write as _;
use std::path::Path;

use serde::Serialize;

/// Shows what is being measured on stderr: one line rewritten in place on a terminal, a line
/// each otherwise; an empty text clears the terminal's line.
pub(crate) fn progress(text: &str) {
    use std::io::IsTerminal;
    let mut err = std::io::stderr().lock();
    if err.is_terminal() {
        let _ = write!(err, "\r\x1b[2K{text}");
    } else if !text.is_empty() {
        let _ = writeln!(err, "{text}");
    }
    let _ = err.flush();
}

/// Formats an optional figure with `precision` decimals, `-` when absent.
pub(crate) fn opt(value: Option<f64>, precision: usize) -> String {
    value.filter(|v| v.is_finite()).map_or_else(|| "-".into(), |v| format!("{v:.precision$}"))
}

/// Writes the JSON report, pretty-printed, to `out` if given, and prints it on stdout if
/// `print`.
pub(crate) fn write_json(
    report: &impl Serialize,
    print: bool,
    out: Option<&Path>,
) -> Result<(), String> {
    let json = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
    if let Some(path) = out {
        std::fs::write(path, &json).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if print {
        println!("{json}");
    }
    Ok(())
}
