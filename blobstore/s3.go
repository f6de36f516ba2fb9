package blobstore

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3types "github.com/aws/aws-sdk-go-v2/service/s3/types"
	gcaws "gocloud.dev/aws"
	"gocloud.dev/blob"
	"gocloud.dev/blob/s3blob"
)

// openS3 opens an s3:// URL as gocloud.dev's s3blob does, and also takes
// credentials from the URL's user and password.
func openS3(ctx context.Context, u *url.URL, q url.Values) (*blob.Bucket, *s3.Client, *s3blob.Options, error) {
	var s3opts []func(*s3.Options)
	var opts s3blob.Options
	for _, name := range []string{"use_path_style", "s3ForcePathStyle", "disable_https", "accelerate"} {
		v := q.Get(name)
		if v == "" {
			continue
		}
		q.Del(name)
		on, err := strconv.ParseBool(v)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("%s=%q: want true or false", name, v)
		}
		switch name {
		case "use_path_style", "s3ForcePathStyle":
			s3opts = append(s3opts, func(o *s3.Options) { o.UsePathStyle = on })
		case "disable_https":
			s3opts = append(s3opts, func(o *s3.Options) { o.EndpointOptions.DisableHTTPS = on })
		case "accelerate":
			s3opts = append(s3opts, func(o *s3.Options) { o.UseAccelerate = on })
		}
	}
	if v := q.Get("ssetype"); v != "" {
		q.Del("ssetype")
		switch t := s3types.ServerSideEncryption(v); t {
		case s3types.ServerSideEncryptionAes256, s3types.ServerSideEncryptionAwsKms, s3types.ServerSideEncryptionAwsKmsDsse:
			opts.EncryptionType = t
		default:
			return nil, nil, nil, fmt.Errorf("ssetype=%q: want AES256, aws:kms or aws:kms:dsse", v)
		}
	}
	if v := q.Get("kmskeyid"); v != "" {
		q.Del("kmskeyid")
		opts.KMSEncryptionID = v
	}
	cfg, err := gcaws.V2ConfigFromURLParams(ctx, q)
	if err != nil {
		return nil, nil, nil, err
	}
	if u.User != nil {
		secret, _ := u.User.Password()
		if u.User.Username() == "" || secret == "" {
			return nil, nil, nil, errors.New("credentials in the URL: want s3://ACCESS_KEY:SECRET@BUCKET")
		}
		cfg.Credentials = aws.NewCredentialsCache(credentials.NewStaticCredentialsProvider(u.User.Username(), secret, ""))
	}
	opts.RequestChecksumCalculation = cfg.RequestChecksumCalculation
	client := s3.NewFromConfig(cfg, s3opts...)
	b, err := s3blob.OpenBucket(ctx, client, u.Host, &opts)
	return b, client, &opts, err
}

// setS3 prepares b's own S3 writer (s3Writer) and abortUploads.
func (b *Bucket) setS3(client *s3.Client, opts *s3blob.Options, bucket, prefix string) {
	b.s3, b.s3Bucket, b.s3Prefix = client, bucket, prefix
	if opts.RequestChecksumCalculation != aws.RequestChecksumCalculationWhenRequired {
		b.s3Checksum = s3types.ChecksumAlgorithmCrc32 // as the SDK's transfer manager does
	}
	b.s3SSE = s3types.ServerSideEncryption(opts.EncryptionType)
	if opts.KMSEncryptionID != "" {
		b.s3KMS = aws.String(opts.KMSEncryptionID)
	}
}

// safeS3Prefix reports whether prefix is kept as it is in S3 object keys
// (gocloud.dev escapes some characters; s3Writer does not).
func safeS3Prefix(prefix string) bool {
	for _, seg := range strings.Split(prefix, "/") {
		if seg == "." || seg == ".." {
			return false
		}
	}
	for _, c := range []byte(prefix) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("/_-.", c) >= 0) {
			return false
		}
	}
	return true
}

// abortUploads aborts the incomplete multipart uploads under prefix that
// started before before, of the blob names mine accepts: what an upload
// cut short (a crash, a killed process) leaves on S3. It reports how many
// it aborted. Other stores have none: 0, nil.
func (b *Bucket) abortUploads(ctx context.Context, prefix string, before time.Time, mine func(name string) bool) (int, error) {
	client := b.s3
	if client == nil {
		return 0, nil
	}
	bucket, keyPrefix := b.s3Bucket, b.s3Prefix+prefix
	aborted := 0
	in := &s3.ListMultipartUploadsInput{Bucket: aws.String(bucket), Prefix: aws.String(keyPrefix)}
	for {
		out, err := client.ListMultipartUploads(ctx, in)
		if err != nil {
			return aborted, fmt.Errorf("blobstore: list incomplete uploads: %w", err)
		}
		for _, up := range out.Uploads {
			if up.Initiated == nil || !up.Initiated.Before(before) || !mine(strings.TrimPrefix(aws.ToString(up.Key), b.s3Prefix)) {
				continue
			}
			if _, err := client.AbortMultipartUpload(ctx, &s3.AbortMultipartUploadInput{Bucket: aws.String(bucket),
				Key: up.Key, UploadId: up.UploadId}); err != nil {
				return aborted, fmt.Errorf("blobstore: abort incomplete upload of %s: %w", aws.ToString(up.Key), err)
			}
			aborted++
		}
		if !aws.ToBool(out.IsTruncated) {
			return aborted, nil
		}
		in.KeyMarker, in.UploadIdMarker = out.NextKeyMarker, out.NextUploadIdMarker
	}
}
