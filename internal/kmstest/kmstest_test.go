package kmstest

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/kms"
	"github.com/aws/aws-sdk-go-v2/service/kms/types"
)

// TestServer: the server answers on its endpoint with the seeded keys, a
// data key it made decrypts under its key only, survives Restart, and a
// stopped server refuses connections.
func TestServer(t *testing.T) {
	s := Start(t)
	ctx := context.Background()
	c := s.Client()
	gen, err := c.GenerateDataKey(ctx, &kms.GenerateDataKeyInput{KeyId: aws.String(s.KeyARN()), KeySpec: types.DataKeySpecAes256})
	if err != nil {
		t.Fatalf("GenerateDataKey: %v\n%s", err, s.LogText())
	}
	if len(gen.Plaintext) != 32 || len(gen.CiphertextBlob) == 0 || aws.ToString(gen.KeyId) != s.KeyARN() {
		t.Fatalf("GenerateDataKey = %d-byte key, %d-byte blob, key %s; want 32 bytes, a blob, %s", len(gen.Plaintext), len(gen.CiphertextBlob), aws.ToString(gen.KeyId), s.KeyARN())
	}
	dec, err := c.Decrypt(ctx, &kms.DecryptInput{CiphertextBlob: gen.CiphertextBlob, KeyId: aws.String(s.KeyARN())})
	if err != nil || !bytes.Equal(dec.Plaintext, gen.Plaintext) {
		t.Fatalf("Decrypt(blob) = %x, %v; want the data key", dec.Plaintext, err)
	}
	_, err = c.Decrypt(ctx, &kms.DecryptInput{CiphertextBlob: gen.CiphertextBlob, KeyId: aws.String(s.OtherKeyARN())})
	var bad *types.InvalidCiphertextException
	if !errors.As(err, &bad) {
		t.Errorf("Decrypt(blob) under the other key: error %v; want InvalidCiphertextException", err)
	}
	if err := s.Restart(); err != nil {
		t.Fatalf("Restart: %v\n%s", err, s.LogText())
	}
	dec, err = c.Decrypt(ctx, &kms.DecryptInput{CiphertextBlob: gen.CiphertextBlob, KeyId: aws.String(s.KeyARN())})
	if err != nil || !bytes.Equal(dec.Plaintext, gen.Plaintext) {
		t.Fatalf("after Restart, Decrypt(blob) = %x, %v; want the data key", dec.Plaintext, err)
	}
	s.Stop()
	if _, err := c.Decrypt(ctx, &kms.DecryptInput{CiphertextBlob: gen.CiphertextBlob}); err == nil {
		t.Error("Decrypt on a stopped server succeeded")
	}
}
