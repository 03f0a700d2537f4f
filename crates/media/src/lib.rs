//! Cache media (stub; being written).
