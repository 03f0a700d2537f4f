//! `rbd:POOL[/NAMESPACE]/IMAGE[:KEY=VALUE]...`: the form qemu and its users write an RBD image
//! in. `id=USER` names the Ceph user (without `client.`), `conf=PATH` the configuration file,
//! `takeover=1` the operator's word that the cache recorded on the image as holding dirty
//! blocks is gone for good (see [`super::RbdImage`]'s claim); any other key is a Ceph option set on the connection (`mon_host=...`,
//! `rados_osd_op_timeout=5`, `rbd_cache=true`). A `:` or `\` inside a value is escaped with
//! `\`. A snapshot (`IMAGE@SNAP`) is refused: a snapshot is read-only, and a cache that
//! writes cannot sit in front of it.

use std::fmt;

/// The prefix that makes a backing path an RBD image.
pub const RBD_PREFIX: &str = "rbd:";

/// A parsed `rbd:` spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdSpec {
    /// The pool's name.
    pub pool: String,
    /// The RADOS namespace within the pool ("" for none).
    pub namespace: String,
    /// The image's name.
    pub image: String,
    /// The Ceph user without `client.` (`None`: librados' default, `admin`).
    pub user: Option<String>,
    /// The configuration file (`None`: librados' search: `$CEPH_CONF`, /etc/ceph/ceph.conf,
    /// ~/.ceph/config, ./ceph.conf).
    pub conf: Option<String>,
    /// `takeover=1`: a claim overrides the record of another cache holding dirty blocks.
    pub takeover: bool,
    /// Other Ceph options, in the order given.
    pub options: Vec<(String, String)>,
}

impl RbdSpec {
    /// Whether `path` is an `rbd:` spec (and not a file path).
    pub fn is_rbd(path: &str) -> bool {
        path.starts_with(RBD_PREFIX)
    }

    /// Parses `rbd:POOL[/NAMESPACE]/IMAGE[:KEY=VALUE]...`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let body = text.strip_prefix(RBD_PREFIX).ok_or_else(|| {
            format!("{text:?} is not an rbd: spec (rbd:POOL/IMAGE[:KEY=VALUE]...)")
        })?;
        let mut fields = split_unescaped(body).into_iter();
        let name = fields.next().unwrap_or_default();
        let parts: Vec<&str> = name.split('/').collect();
        let (pool, namespace, image) = match parts.as_slice() {
            [pool, image] => (*pool, "", *image),
            [pool, namespace, image] => (*pool, *namespace, *image),
            _ => {
                return Err(format!(
                    "{text:?}: expected rbd:POOL/IMAGE or rbd:POOL/NAMESPACE/IMAGE before the \
                     options"
                ));
            }
        };
        if pool.is_empty() || image.is_empty() {
            return Err(format!("{text:?}: the pool and the image must be named"));
        }
        if image.contains('@') {
            return Err(format!(
                "{text:?}: a snapshot is read-only and cannot be a cache's backing store; give \
                 the image itself"
            ));
        }
        let mut spec = RbdSpec {
            pool: pool.into(),
            namespace: namespace.into(),
            image: image.into(),
            user: None,
            conf: None,
            takeover: false,
            options: Vec::new(),
        };
        for field in fields {
            let Some((key, value)) = field.split_once('=') else {
                return Err(format!("{text:?}: option {field:?} is not KEY=VALUE"));
            };
            if key.is_empty() {
                return Err(format!("{text:?}: option {field:?} has no key"));
            }
            match key {
                "id" => spec.user = Some(value.into()),
                "conf" => spec.conf = Some(value.into()),
                "takeover" => {
                    spec.takeover = match value {
                        "1" | "true" | "yes" => true,
                        "0" | "false" | "no" => false,
                        _ => {
                            return Err(format!(
                                "{text:?}: takeover={value:?}: expected takeover=1 (or 0)"
                            ));
                        }
                    }
                }
                _ => spec.options.push((key.into(), value.into())),
            }
        }
        Ok(spec)
    }

    /// The image as Ceph's tools name it: `POOL[/NAMESPACE]/IMAGE`.
    pub fn image_path(&self) -> String {
        if self.namespace.is_empty() {
            format!("{}/{}", self.pool, self.image)
        } else {
            format!("{}/{}/{}", self.pool, self.namespace, self.image)
        }
    }

    /// The value given for Ceph option `key`, if any.
    pub fn option(&self, key: &str) -> Option<&str> {
        self.options.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

impl fmt::Display for RbdSpec {
    /// The spec without its options: what messages name the store by.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{RBD_PREFIX}{}", self.image_path())
    }
}

/// Splits at `:` not escaped by `\`, removing the escapes.
fn split_unescaped(text: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    fields.last_mut().expect("one field").push(next);
                }
            }
            ':' => fields.push(String::new()),
            _ => fields.last_mut().expect("one field").push(c),
        }
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_forms_qemu_users_write_parse() {
        let spec = RbdSpec::parse("rbd:vols/db1").expect("parse");
        assert_eq!(
            (spec.pool.as_str(), spec.namespace.as_str(), spec.image.as_str()),
            ("vols", "", "db1")
        );
        assert_eq!((spec.user.as_deref(), spec.conf.as_deref()), (None, None));
        assert_eq!(spec.to_string(), "rbd:vols/db1");

        let spec = RbdSpec::parse(
            r"rbd:vols/tenant1/db1:id=cinder:conf=/etc/ceph/c.conf:mon_host=10.0.0.1\:6789:rbd_cache=false",
        )
        .expect("parse");
        assert_eq!(spec.image_path(), "vols/tenant1/db1");
        assert_eq!(spec.user.as_deref(), Some("cinder"));
        assert_eq!(spec.conf.as_deref(), Some("/etc/ceph/c.conf"));
        assert_eq!(spec.option("mon_host"), Some("10.0.0.1:6789"));
        assert_eq!(spec.option("rbd_cache"), Some("false"));
        assert_eq!(spec.option("rbd_cache_size"), None);
        assert!(!spec.takeover);

        let spec = RbdSpec::parse("rbd:vols/db1:takeover=1:rbd_cache=false").expect("parse");
        assert!(spec.takeover, "takeover=1 is the override, not a Ceph option");
        assert_eq!(spec.option("takeover"), None);
        assert_eq!(spec.to_string(), "rbd:vols/db1");
        assert!(!RbdSpec::parse("rbd:vols/db1:takeover=0").expect("parse").takeover);
    }

    #[test]
    fn malformed_specs_are_refused_with_the_reason() {
        for (text, says) in [
            ("rbd:", "expected rbd:POOL/IMAGE"),
            ("rbd:img", "expected rbd:POOL/IMAGE"),
            ("rbd:a/b/c/d", "expected rbd:POOL/IMAGE"),
            ("rbd:/img", "must be named"),
            ("rbd:pool/", "must be named"),
            ("rbd:pool/img@snap1", "snapshot is read-only"),
            ("rbd:pool/img:id", "is not KEY=VALUE"),
            ("rbd:pool/img:=x", "has no key"),
            ("rbd:pool/img:takeover=maybe", "expected takeover=1"),
            ("/dev/sdb", "not an rbd: spec"),
        ] {
            let err = RbdSpec::parse(text).expect_err(text);
            assert!(err.contains(says), "{text}: {err}");
        }
        assert!(RbdSpec::is_rbd("rbd:p/i") && !RbdSpec::is_rbd("./rbd:p/i"));
    }
}
