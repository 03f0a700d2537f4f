//! `pmcache serve --config FILE`: a TOML file of `serve`'s settings, one key per flag under
//! the flag's own name (`cache-size = "1G"`, `mode = "write-back"`, `cleaner = ["order=lba"]`,
//! `ublk = true`). The file becomes the flags it stands for, put before those of the command
//! line, and clap reads them all: a value is checked, and refused, with the same words as
//! the flag's, and a flag given on the command line replaces the file's setting of it.

use std::ffi::OsString;
use std::path::Path;

/// The command line with `serve --config FILE` replaced by the flags of FILE (before the
/// command line's own, which replace the settings they name); any other command line as it
/// is.
pub fn expand(argv: Vec<OsString>, serve: &clap::Command) -> Result<Vec<OsString>, String> {
    let Some(at) = argv.iter().position(|a| a == "serve") else { return Ok(argv) };
    let (given, file) = take_config(&argv[at + 1..])?;
    let Some(file) = file else { return Ok(argv) };
    let text = std::fs::read_to_string(&file)
        .map_err(|e| format!("--config {}: {e}", Path::new(&file).display()))?;
    let flags = flags_of(&text, serve, &given)
        .map_err(|e| format!("--config {}: {e}", Path::new(&file).display()))?;
    let mut expanded: Vec<OsString> = argv[..=at].to_vec();
    expanded.extend(flags.into_iter().map(OsString::from));
    expanded.extend(given);
    Ok(expanded)
}

/// The arguments after `serve` without `--config FILE`, and FILE.
fn take_config(args: &[OsString]) -> Result<(Vec<OsString>, Option<OsString>), String> {
    let mut rest = Vec::with_capacity(args.len());
    let mut file = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let text = arg.to_string_lossy();
        if text == "--config" {
            let path = args.next().ok_or("--config needs a FILE")?;
            file = Some(path.clone());
        } else if let Some(path) = text.strip_prefix("--config=") {
            file = Some(OsString::from(path));
        } else {
            rest.push(arg.clone());
        }
    }
    Ok((rest, file))
}

/// The flags `text` (TOML) stands for, leaving out those `given` on the command line.
fn flags_of(text: &str, serve: &clap::Command, given: &[OsString]) -> Result<Vec<String>, String> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| e.to_string())?;
    let named = |long: &str| {
        given.iter().any(|a| {
            let a = a.to_string_lossy();
            a == format!("--{long}") || a.starts_with(&format!("--{long}="))
        })
    };
    let mut flags = Vec::new();
    for (key, value) in &table {
        let arg = serve
            .get_arguments()
            .find(|arg| arg.get_long() == Some(key.as_str()) && key != "config")
            .ok_or_else(|| {
                format!(
                    "{key:?} is not a setting of `pmcache serve` (its flags, \
                 without the leading --, are: `pmcache serve --help`)"
                )
            })?;
        if named(key) {
            continue;
        }
        let takes_value = arg.get_action().takes_values();
        match (value, takes_value) {
            (toml::Value::Boolean(true), false) => flags.push(format!("--{key}")),
            (toml::Value::Boolean(false), false) => {}
            (_, false) => return Err(format!("{key}: true or false")),
            (toml::Value::Array(values), true) => {
                for value in values {
                    flags.push(format!("--{key}={}", scalar(key, value)?));
                }
            }
            (value, true) => flags.push(format!("--{key}={}", scalar(key, value)?)),
        }
    }
    Ok(flags)
}

/// A value as its flag would be written.
fn scalar(key: &str, value: &toml::Value) -> Result<String, String> {
    match value {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(n) => Ok(n.to_string()),
        toml::Value::Float(x) => Ok(x.to_string()),
        toml::Value::Boolean(b) => Ok(b.to_string()),
        other => Err(format!("{key}: a {} is not a value of this setting", other.type_str())),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    fn serve() -> clap::Command {
        crate::Cli::command().find_subcommand("serve").expect("serve").clone()
    }

    fn expanded(file: &str, args: &[&str]) -> Result<Vec<String>, String> {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("pmcache.toml");
        std::fs::write(&path, file).expect("write");
        let mut argv: Vec<OsString> = vec!["pmcache".into(), "serve".into()];
        argv.push("--config".into());
        argv.push(path.into_os_string());
        argv.extend(args.iter().map(OsString::from));
        expand(argv, &serve()).map(|a| a.iter().map(|s| s.to_string_lossy().into()).collect())
    }

    /// Every kind of setting becomes its flag: values, booleans, repeated flags.
    #[test]
    fn settings_become_flags() {
        let argv = expanded(
            "cache = \"/dev/shm/a.pm\"\ncache-size = \"64M\"\nmode = \"write-through\"\n\
             data-crc = true\nallow-remote = false\nmax-connections = 4\n\
             cleaner = [\"order=lba\", \"nice_base=5\"]\nwrite-timeout = 2.5\n",
            &[],
        )
        .expect("expanded");
        for flag in [
            "--cache=/dev/shm/a.pm",
            "--cache-size=64M",
            "--mode=write-through",
            "--data-crc",
            "--max-connections=4",
            "--cleaner=order=lba",
            "--cleaner=nice_base=5",
            "--write-timeout=2.5",
        ] {
            assert!(argv.iter().any(|a| a == flag), "{flag} missing from {argv:?}");
        }
        assert!(!argv.iter().any(|a| a.contains("allow-remote")), "{argv:?}");
        assert!(!argv.iter().any(|a| a.contains("config")), "{argv:?}");
    }

    /// A flag on the command line replaces the file's setting of it.
    #[test]
    fn the_command_line_overrides_the_file() {
        let argv = expanded("mode = \"write-through\"\nexport = \"a\"\n", &["--mode", "writeback"])
            .expect("expanded");
        assert!(!argv.iter().any(|a| a == "--mode=write-through"), "{argv:?}");
        assert!(argv.windows(2).any(|w| w[0] == "--mode" && w[1] == "writeback"), "{argv:?}");
        assert!(argv.iter().any(|a| a == "--export=a"), "{argv:?}");
    }

    /// Unknown keys, values of the wrong type and files that are not TOML are refused by
    /// name; a bad value is refused by clap as the flag's would be.
    #[test]
    fn mistakes_are_refused_with_what_is_wrong() {
        let unknown = expanded("mdoe = \"writeback\"\n", &[]).expect_err("unknown key");
        assert!(unknown.contains("\"mdoe\" is not a setting"), "{unknown}");
        let flag = expanded("data-crc = \"yes\"\n", &[]).expect_err("a bool flag given a string");
        assert!(flag.contains("data-crc: true or false"), "{flag}");
        let table = expanded("cache = { path = \"x\" }\n", &[]).expect_err("a table");
        assert!(table.contains("cache: a table"), "{table}");
        let syntax = expanded("mode = \n", &[]).expect_err("not TOML");
        assert!(syntax.contains("--config"), "{syntax}");
        let argv = expanded("mode = \"sideways\"\n", &[]).expect("expanded");
        let err = match crate::Cli::try_parse_from(argv) {
            Ok(_) => panic!("an unknown mode accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("sideways") && err.contains("--mode"), "{err}");
    }

    /// A missing file is named.
    #[test]
    fn a_missing_file_is_named() {
        let argv: Vec<OsString> =
            ["pmcache", "serve", "--config", "/nonexistent/pmcache.toml"].map(Into::into).into();
        let err = expand(argv, &serve()).expect_err("missing");
        assert!(err.contains("/nonexistent/pmcache.toml"), "{err}");
    }
}
