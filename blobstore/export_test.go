package blobstore

// PartSize is the S3 writer's part size, for TestS3WriterMemory's bound.
const PartSize = partSize
